// Runs first: every script error and every request the page's policy blocks is written into the page, so a
// reader (and a test reading the DOM) sees it. The page must load nothing: a blocked request is a defect.
"use strict";
(function () {
  var root = document.documentElement;
  var seen = [];
  function record(message) {
    seen.push(message);
    root.setAttribute("data-errors", String(seen.length));
    var show = function () {
      var box = document.getElementById("report-errors");
      if (box) { box.hidden = false; box.textContent = "This page hit errors:\n" + seen.join("\n"); }
    };
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", show); else show();
  }
  window.reportError = record;
  window.addEventListener("error", function (e) {
    if (e.target && e.target !== window && e.target.tagName) {
      record("could not load <" + e.target.tagName.toLowerCase() + ">");
    } else {
      record("script error: " + e.message + " (line " + e.lineno + ")");
    }
  }, true);
  window.addEventListener("unhandledrejection", function (e) { record("script error: " + e.reason); });
  document.addEventListener("securitypolicyviolation", function (e) {
    record("blocked by the page's policy: " + (e.blockedURI || "inline") + " (" + e.violatedDirective + ")");
  });
  root.setAttribute("data-errors", "0");
})();
