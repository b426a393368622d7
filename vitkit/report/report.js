// Draws the page's charts as inline SVG from the JSON in #report-data: hover for the values, drag across the plot
// (or Ctrl + wheel, or pinch) to zoom into a range of x, double-click or "reset zoom" to see it all; with the
// plot focused, + and - zoom, the arrow keys pan and 0 resets. When everything is drawn, <html data-status>
// reads "drawn" and each chart and image carries its drawn size in data-box ("WxH"), for whoever checks.
"use strict";
(function () {
  var SVG = "http://www.w3.org/2000/svg";
  var M = { right: 14, top: 10, bottom: 38 }; // the left margin follows the widest y label

  function el(name, attrs, parent) {
    var node = document.createElementNS(SVG, name);
    for (var k in attrs) node.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(node);
    return node;
  }

  function niceStep(span, count) {
    var raw = span / Math.max(1, count);
    var mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var norm = raw / mag;
    return (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
  }

  function ticks(lo, hi, count) {
    if (!(hi > lo)) return [lo];
    var step = niceStep(hi - lo, count), out = [];
    for (var v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return out;
  }

  function format(v, kind) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    if (kind === "percent") return (100 * v).toFixed(Math.abs(v) < 0.1 ? 2 : 1) + "%";
    if (kind === "sci") return v === 0 ? "0" : v.toExponential(2);
    var a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
    return String(Number(v.toPrecision(4)));
  }

  function Chart(figure, spec) {
    this.figure = figure;
    this.spec = spec;
    this.plot = figure.querySelector(".plot");
    this.reset = figure.querySelector("button.reset");
    var xs = [];
    spec.series.forEach(function (s) { s.x.forEach(function (x, i) { if (s.y[i] !== null) xs.push(x); }); });
    var lo = Math.min.apply(null, xs), hi = Math.max.apply(null, xs);
    if (!xs.length) { lo = 0; hi = 1; }
    if (hi === lo) { lo -= Math.max(1, Math.abs(lo) * 0.05); hi += Math.max(1, Math.abs(hi) * 0.05); }
    this.full = [lo, hi];
    this.view = [lo, hi];
    this.legend();
    this.listen();
  }

  Chart.prototype.legend = function () {
    var ul = this.figure.querySelector("ul.legend");
    ul.textContent = "";
    this.spec.series.forEach(function (s, i) {
      var li = document.createElement("li");
      li.className = "s" + (i % 6);
      li.innerHTML = '<span class="swatch"></span>';
      var name = document.createElement("span");
      name.className = "name";
      name.textContent = s.name + (s.dashed && s.x.length > 1 ? " (dashed)" : "");
      li.appendChild(name);
      ul.appendChild(li);
    });
  };

  Chart.prototype.ty = function (v) { return this.spec.log ? Math.log10(v) : v; };

  Chart.prototype.draw = function () {
    var spec = this.spec, self = this;
    var W = Math.max(200, this.plot.clientWidth || 600);
    var H = Math.round(Math.min(340, Math.max(210, W * 0.58)));
    this.W = W; this.H = H;
    var x0 = this.view[0], x1 = this.view[1];
    // y range: the points in view (and the neighbours that draw the lines into it)
    var ylo = Infinity, yhi = -Infinity;
    spec.series.forEach(function (s) {
      s.x.forEach(function (x, i) {
        var y = s.y[i];
        if (y === null || (spec.log && y <= 0)) return;
        if (x >= x0 && x <= x1) { var t = self.ty(y); ylo = Math.min(ylo, t); yhi = Math.max(yhi, t); }
      });
    });
    if (!isFinite(ylo)) { ylo = 0; yhi = 1; }
    if (yhi === ylo) { var pad = Math.abs(ylo) * 0.05 || 0.5; ylo -= pad; yhi += pad; }
    var span = yhi - ylo; ylo -= span * 0.06; yhi += span * 0.06;
    if (spec.yFormat === "percent" && !spec.log) { ylo = Math.max(ylo, Math.min(0, ylo)); }
    this.yr = [ylo, yhi];
    var yt;
    if (spec.log) {
      yt = [];
      for (var e = Math.floor(ylo); e <= Math.ceil(yhi); e++) {
        [1, 2, 5].forEach(function (m) { var t = e + Math.log10(m); if (t >= ylo && t <= yhi) yt.push(t); });
      }
      if (yt.length > 8) yt = yt.filter(function (t) { return Math.abs(t - Math.round(t)) < 1e-9; });
      if (yt.length < 2) yt = ticks(ylo, yhi, 4);
    } else {
      yt = ticks(ylo, yhi, Math.max(2, Math.floor((H - M.top - M.bottom) / 45)));
    }
    var labels = yt.map(function (t) { return format(spec.log ? Math.pow(10, t) : t, spec.yFormat); });
    var left = 24 + 6.5 * Math.max.apply(null, labels.map(function (l) { return l.length; }));
    this.left = left;
    var pw = W - left - M.right, ph = H - M.top - M.bottom, inset = 6; // points on the edges stay whole
    this.sx = function (x) { return left + inset + (x - x0) / (x1 - x0) * (pw - 2 * inset); };
    this.sy = function (t) { return M.top + (1 - (t - ylo) / (yhi - ylo)) * ph; };
    this.ix = function (px) { return x0 + (px - left - inset) / (pw - 2 * inset) * (x1 - x0); };

    var svg = el("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, "aria-hidden": "true" });
    var clip = "clip-" + spec.id;
    el("rect", { x: left, y: M.top, width: pw, height: ph }, el("clipPath", { id: clip }, el("defs", {}, svg)));
    var grid = el("g", { "class": "grid" }, svg), axis = el("g", { "class": "axis" }, svg);
    ticks(x0, x1, Math.max(2, Math.floor(pw / 80))).forEach(function (x) {
      var px = self.sx(x);
      el("line", { x1: px, x2: px, y1: M.top, y2: M.top + ph }, grid);
      var t = el("text", { x: px, y: M.top + ph + 15, "text-anchor": "middle" }, axis);
      t.textContent = format(x, "number");
    });
    yt.forEach(function (t, i) {
      var py = self.sy(t);
      el("line", { x1: left, x2: left + pw, y1: py, y2: py }, grid);
      var txt = el("text", { x: left - 6, y: py + 4, "text-anchor": "end" }, axis);
      txt.textContent = labels[i];
    });
    el("rect", { x: left, y: M.top, width: pw, height: ph, "class": "frame" }, svg);
    var xl = el("text", { x: left + pw / 2, y: H - 4, "text-anchor": "middle", "class": "axis-label" }, svg);
    xl.textContent = spec.xLabel + (this.zoomed() ? " (zoomed)" : "");
    var yl = el("text", { transform: "translate(12," + (M.top + ph / 2) + ") rotate(-90)", "text-anchor": "middle",
      "class": "axis-label" }, svg);
    yl.textContent = spec.yLabel + (spec.log ? " (log scale)" : "");

    var lines = el("g", { "clip-path": "url(#" + clip + ")" }, svg), drawn = 0;
    spec.series.forEach(function (s, k) {
      var d = "", pen = false, visible = 0;
      s.x.forEach(function (x, i) {
        var y = s.y[i];
        if (y === null || (spec.log && y <= 0)) { pen = false; return; }
        d += (pen ? "L" : "M") + self.sx(x).toFixed(1) + " " + self.sy(self.ty(y)).toFixed(1);
        pen = true;
        if (x >= x0 && x <= x1) visible++;
      });
      el("path", { d: d, "class": "line s" + (k % 6) + (s.dashed ? " dashed" : "") }, lines);
      if (visible <= 40) {
        s.x.forEach(function (x, i) {
          var y = s.y[i];
          if (y === null || (spec.log && y <= 0) || x < x0 || x > x1) return;
          el("circle", { cx: self.sx(x), cy: self.sy(self.ty(y)), r: 3, "class": "s" + (k % 6) }, lines);
        });
      }
      drawn += visible;
    });
    this.cursor = el("line", { y1: M.top, y2: M.top + ph, "class": "cursor", visibility: "hidden" }, svg);
    this.dots = el("g", {}, svg);
    this.selection = el("rect", { y: M.top, height: ph, width: 0, "class": "selection", visibility: "hidden" }, svg);
    var old = this.plot.querySelector("svg");
    if (old) this.plot.replaceChild(svg, old); else this.plot.insertBefore(svg, this.plot.firstChild);
    this.svg = svg;
    this.reset.hidden = !this.zoomed();
    this.figure.setAttribute("data-points", String(drawn));
    this.figure.setAttribute("data-view", format(x0, "number") + ".." + format(x1, "number"));
  };

  Chart.prototype.zoomed = function () { return this.view[0] > this.full[0] || this.view[1] < this.full[1]; };

  Chart.prototype.setView = function (lo, hi) {
    var f = this.full, minSpan = (f[1] - f[0]) / 1000;
    if (hi - lo < minSpan) { var c = (lo + hi) / 2; lo = c - minSpan / 2; hi = c + minSpan / 2; }
    if (lo < f[0]) { hi += f[0] - lo; lo = f[0]; }
    if (hi > f[1]) { lo -= hi - f[1]; hi = f[1]; }
    this.view = [Math.max(f[0], lo), Math.min(f[1], hi)];
    this.hideTip();
    this.draw();
  };

  Chart.prototype.zoomAround = function (x, factor) {
    var v = this.view;
    this.setView(x - (x - v[0]) * factor, x + (v[1] - x) * factor);
  };

  Chart.prototype.hideTip = function () {
    if (this.tip) this.tip.hidden = true;
    if (this.cursor) this.cursor.setAttribute("visibility", "hidden");
    if (this.dots) this.dots.textContent = "";
  };

  // the value of every series at the point nearest the pointer's x
  Chart.prototype.hover = function (px) {
    var spec = this.spec, self = this, x = this.ix(px), best = null, rows = [];
    spec.series.forEach(function (s, k) {
      var near = -1, dist = Infinity;
      s.x.forEach(function (sx, i) {
        if (s.y[i] === null || sx < self.view[0] || sx > self.view[1]) return;
        var d = Math.abs(sx - x);
        if (d < dist) { dist = d; near = i; }
      });
      if (near < 0) return;
      rows.push({ k: k, s: s, i: near, d: dist });
      if (best === null || dist < best.d) best = { x: s.x[near], d: dist };
    });
    if (best === null) { this.hideTip(); return; }
    var cx = this.sx(best.x);
    this.cursor.setAttribute("x1", cx); this.cursor.setAttribute("x2", cx);
    this.cursor.setAttribute("visibility", "visible");
    this.dots.textContent = "";
    if (!this.tip) {
      this.tip = document.createElement("div");
      this.tip.className = "tooltip";
      this.tip.setAttribute("role", "status");
      this.plot.appendChild(this.tip);
    }
    var head = spec.xLabel + " " + format(best.x, "number");
    if (spec.xPerEpoch) head += " · epoch " + format(best.x / spec.xPerEpoch, "number");
    var html = "<strong></strong>";
    this.tip.innerHTML = html;
    this.tip.firstChild.textContent = head;
    rows.forEach(function (r) {
      var y = r.s.y[r.i], line = document.createElement("div");
      line.className = "s" + (r.k % 6);
      line.innerHTML = '<span class="swatch"></span>';
      var text = document.createElement("span");
      text.style.color = "var(--fg)";
      text.textContent = r.s.name + ": " + format(y, spec.yFormat) +
        (r.s.x[r.i] !== best.x ? " (" + spec.xLabel + " " + format(r.s.x[r.i], "number") + ")" : "");
      line.appendChild(text);
      self.tip.appendChild(line);
      if (!(spec.log && y <= 0)) {
        el("circle", { cx: self.sx(r.s.x[r.i]), cy: self.sy(self.ty(y)), r: 4.5, "class": "s" + (r.k % 6) }, self.dots);
      }
    });
    this.tip.hidden = false;
    var left = cx + 12;
    if (left + this.tip.offsetWidth > this.W) left = Math.max(0, cx - 12 - this.tip.offsetWidth);
    this.tip.style.left = left + "px";
    this.tip.style.top = M.top + 4 + "px";
    this.figure.setAttribute("data-tooltip", this.tip.textContent);
  };

  Chart.prototype.local = function (e) {
    var r = this.plot.getBoundingClientRect();
    return e.clientX - r.left;
  };

  Chart.prototype.listen = function () {
    var self = this, plot = this.plot, drag = null;
    plot.addEventListener("pointerdown", function (e) {
      if (e.button !== 0) return;
      drag = { start: self.local(e), id: e.pointerId };
      try { plot.setPointerCapture(e.pointerId); } catch (err) { /* a pointer the browser does not track */ }
    });
    plot.addEventListener("pointermove", function (e) {
      var px = self.local(e);
      if (drag) {
        var a = Math.max(self.left, Math.min(drag.start, px)), b = Math.min(self.W - M.right, Math.max(drag.start, px));
        self.selection.setAttribute("x", a);
        self.selection.setAttribute("width", Math.max(0, b - a));
        self.selection.setAttribute("visibility", "visible");
      }
      self.hover(px);
    });
    var finish = function (e) {
      if (!drag) return;
      var a = Math.min(drag.start, self.local(e)), b = Math.max(drag.start, self.local(e));
      drag = null;
      self.selection.setAttribute("visibility", "hidden");
      if (b - a > 6) self.setView(self.ix(Math.max(a, self.left)), self.ix(Math.min(b, self.W - M.right)));
    };
    plot.addEventListener("pointerup", finish);
    plot.addEventListener("pointercancel", function () { drag = null; self.hideTip(); });
    plot.addEventListener("pointerleave", function () { if (!drag) self.hideTip(); });
    plot.addEventListener("wheel", function (e) {
      if (!e.ctrlKey) return; // plain wheel scrolls the page; Ctrl + wheel (and a pinch) zooms
      e.preventDefault();
      self.zoomAround(self.ix(self.local(e)), e.deltaY > 0 ? 1.25 : 0.8);
    }, { passive: false });
    plot.addEventListener("dblclick", function () { self.setView(self.full[0], self.full[1]); });
    this.reset.addEventListener("click", function () { self.setView(self.full[0], self.full[1]); });
    plot.addEventListener("keydown", function (e) {
      var v = self.view, c = (v[0] + v[1]) / 2, pan = (v[1] - v[0]) * 0.2;
      if (e.key === "+" || e.key === "=") self.zoomAround(c, 0.7);
      else if (e.key === "-") self.zoomAround(c, 1 / 0.7);
      else if (e.key === "0") self.setView(self.full[0], self.full[1]);
      else if (e.key === "ArrowLeft") self.setView(v[0] - pan, v[1] - pan);
      else if (e.key === "ArrowRight") self.setView(v[0] + pan, v[1] + pan);
      else return;
      e.preventDefault();
    });
  };

  function box(node) {
    var r = node.getBoundingClientRect();
    return Math.round(r.width) + "x" + Math.round(r.height);
  }

  var root = document.documentElement;
  var charts = [];
  try {
    var data = JSON.parse(document.getElementById("report-data").textContent);
    document.querySelectorAll("figure.chart").forEach(function (figure) {
      var spec = data[figure.getAttribute("data-chart")];
      if (!spec) throw new Error("no data for the chart " + figure.getAttribute("data-chart"));
      var chart = new Chart(figure, spec);
      chart.draw();
      charts.push(chart);
    });
    var pending = false;
    window.addEventListener("resize", function () {
      if (pending) return;
      pending = true;
      window.requestAnimationFrame(function () {
        pending = false;
        charts.forEach(function (c) { if (c.plot.clientWidth && c.plot.clientWidth !== c.W) c.draw(); });
      });
    });
  } catch (err) {
    window.reportError("script error: " + (err && err.message ? err.message : err));
  }

  function measured() {
    charts.forEach(function (c) { c.figure.setAttribute("data-box", box(c.svg)); });
    var broken = 0;
    document.querySelectorAll("img").forEach(function (img) {
      img.setAttribute("data-natural", img.naturalWidth + "x" + img.naturalHeight);
      img.setAttribute("data-box", box(img));
      if (!img.complete || img.naturalWidth === 0) broken++;
    });
    if (broken) window.reportError(broken + " image(s) could not be drawn");
    // a page wider than the window scrolls sideways: the widths say whether it fits
    root.setAttribute("data-widths", root.clientWidth + " " + root.scrollWidth);
    root.setAttribute("data-status", root.getAttribute("data-errors") === "0" ? "drawn" : "failed");
  }
  if (document.readyState === "complete") measured(); else window.addEventListener("load", measured);
})();
