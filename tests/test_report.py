"""The run report: one self-contained HTML page, written at the end of `vitkit train` and by `vitkit report`.

A tiny real digits run is trained once; its page is checked as text (nothing fetched, images embedded, the
numbers agree with the run's own evaluation and with an independent float64 recount), and rendered in headless
Chromium (drawn without script errors, every chart and image with a size, hover and zoom work, the page's
policy blocks and reports a request), with screenshots in a wide and a narrow window.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
import shutil
import statistics
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import vitkit
from vitkit.cli import main as cli_main
from vitkit.data import DataConfig, build_datasets
from vitkit.report import Chart, Page, Series
from vitkit.report.evaluation import confusion_matrix
from vitkit.report.html import CSP
from vitkit.report.run import REPORT_HOOKS
from vitkit.train import load_config, train

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """`vitkit train digits schedule.steps=30` (train records every 5 steps), which writes report.html (the
    training calls the report's hooks, as the command line passes them)."""
    out = tmp_path_factory.mktemp("runs")
    cfg = load_config(
        "digits",
        [
            "schedule.steps=30",
            "schedule.epochs=none",
            "run.log_every=5",
            f"run.out_dir={out}",
            "run.progress=false",
            "run.threads=1",
        ],
    )
    return train(cfg, REPORT_HOOKS).run_dir


@pytest.fixture(scope="module")
def page(run_dir) -> str:
    return (run_dir / "report.html").read_text()


class Elements(HTMLParser):
    """Every start tag as (tag, attributes, inside a <details>)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str], bool]] = []
        self.details = 0
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, {k: v or "" for k, v in attrs}, self.details > 0))
        self.details += tag == "details"

    def handle_endtag(self, tag):
        self.details -= tag == "details"

    def all(self, tag: str) -> list[dict[str, str]]:
        return [a for t, a, _ in self.found if t == tag]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------------------------- the file
def test_training_writes_a_page_that_needs_nothing_else(page):
    elements = Elements(page)
    metas = elements.all("meta")
    assert {"http-equiv": "Content-Security-Policy", "content": CSP} in metas
    assert "default-src 'none'" in CSP and "img-src data:" in CSP
    for tag, attrs, _ in elements.found:  # nothing points outside the file
        for key in ("src", "href", "srcset", "action", "data", "poster"):
            value = attrs.get(key, "")
            assert not re.match(r"^\s*(https?:|//|file:|ftp:)", value, re.I), f"<{tag} {key}={value[:60]}>"
            if key == "href" and key in attrs:
                assert value.startswith("#"), f"<{tag} href={value}>: only links within the page"
    assert not elements.all("link") and not [s for s in elements.all("script") if "src" in s]
    assert "url(" not in page.split("<style>", 1)[1].split("</style>", 1)[0]  # no fetched fonts or images in CSS
    images = elements.all("img")
    assert len(images) >= 16 + 4  # the worst-classified images and the inspection figures
    for img in images:
        assert img["src"].startswith("data:image/png;base64,") and img["alt"].strip()
        png = Image.open(io.BytesIO(base64.b64decode(img["src"].split(",", 1)[1])))
        assert png.format == "PNG" and min(png.size) > 0
    # every section the issue asks for, with its figures
    for section in ("result", "config", "curves", "evaluation", "inspection", "environment", "commands"):
        assert f'<section id="{section}">' in page
    for figure in ("Fig 7 left", "Fig 7 centre", "Fig 7 right / Fig 11", "Fig 6"):
        assert f"{figure}:" in page  # in an image's alt text
    charts = {a["data-chart"] for a in elements.all("figure") if "data-chart" in a}
    assert charts == {"loss", "accuracy", "lr", "throughput"}


def test_the_numbers_agree_with_the_run_and_an_independent_recount(run_dir, page):
    final = [r for r in records(run_dir) if r["kind"] == "eval"][-1]
    # the confusion matrix: 360 images, its diagonal the run's own final top-1
    matrix = page.split('class="confusion"', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr><th scope=\"row\">.*?</tr>", matrix)
    counts = np.array([[int(v) for v in re.findall(r'title="[^"]*">(\d+)</td>', row)] for row in rows])
    assert counts.shape == (10, 10) and counts.sum() == 360 == final["eval_images"]
    assert np.trace(counts) / 360 == pytest.approx(final["eval_top1"], abs=1e-9)
    # the worst-classified images: the 16 lowest true-class probabilities, recomputed here in float64
    model = vitkit.load_model(run_dir)
    _, eval_set, _ = build_datasets(DataConfig(source="digits", img_size=16))
    with torch.no_grad():
        logits = model.eval()(eval_set.images).double()
    p_true = logits.softmax(-1).gather(1, eval_set.labels[:, None])[:, 0].numpy()
    shown = [int(i) for i in re.findall(r"p\(true\) [\d.]+% · #(\d+)", page)]
    assert len(shown) == 16
    assert sorted(p_true[shown]) == pytest.approx(sorted(np.sort(p_true)[:16]), abs=1e-6)
    pred = logits.argmax(-1).numpy()
    recount = confusion_matrix(eval_set.labels.numpy(), pred, 10)
    assert (recount == counts).all()
    # the headline is the run's final evaluation
    assert f"{100 * final['eval_top1']:.2f}%" in page.split('<section id="config">')[0]


def test_confusion_matrix_matches_scikit_learn():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    y, p = rng.integers(0, 7, 500), rng.integers(0, 7, 500)
    assert (confusion_matrix(y, p, 7) == metrics.confusion_matrix(y, p, labels=range(7))).all()


def test_config_table_highlights_what_the_command_line_changed(page):
    table = page.split('<section id="config">', 1)[1].split("<details>", 1)[0].replace("<wbr>", "")
    changed = set(re.findall(r'<tr class="changed"><th scope="row">([\w.]+)</th>', table))
    # the overrides of the fixture, against the shipped digits.yaml the run is named after
    assert {"schedule.steps", "schedule.epochs", "run.log_every", "run.out_dir", "run.progress"} <= changed
    assert "model.width" not in changed and "optim.lr" not in changed
    listed = set(re.findall(r'<tr(?: class="changed")?><th scope="row">([\w.]+)</th>', table))
    assert {"model.width", "optim.lr"} <= listed  # they differ from the defaults (registry row, TrainConfig)


def test_commands_resume_and_rerun_this_run(run_dir, page):
    commands = page.split('<section id="commands">', 1)[1]
    assert f"cd {run_dir.parent.parent}" in commands or f"{run_dir}/config.yaml run.resume=true" in commands
    assert "run.resume=true" in commands and "vitkit eval" in commands and "picks the newest" not in commands


def test_cli_report_and_a_run_without_weights(run_dir, tmp_path, capsys):
    out = tmp_path / "page.html"
    assert cli_main(["report", str(run_dir), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out and out.stat().st_size > 10_000
    bare = tmp_path / "bare"  # a run killed before its first save: config and metrics only
    bare.mkdir()
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(run_dir / name, bare / name)
    assert cli_main(["report", str(bare)]) == 0
    text = (bare / "report.html").read_text()
    assert "No model.safetensors yet" in text and 'data-chart="loss"' in text
    assert cli_main(["report", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a training run directory" in err


def test_a_run_whose_data_moved_still_gets_its_page(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for k in range(2):
        (tmp_path / "data" / f"class{k}").mkdir(parents=True)
        for i in range(12):
            pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "data" / f"class{k}" / f"{i}.png")
    model = "model.name=vit_ti16 model.patch_size=8 model.width=16 model.depth=1 model.num_heads=2 model.mlp_dim=32"
    args = [*model.split(), "schedule.steps=2", "schedule.epochs=none", "schedule.warmup_steps=0", "optim.batch_size=8"]
    args += [f"run.out_dir={tmp_path / 'runs'}", "run.name=r", "run.progress=false", "run.threads=1", "run.plots=false"]
    assert cli_main(["train", "digits", "--data", str(tmp_path / "data"), *args]) == 0
    (tmp_path / "data").rename(tmp_path / "moved")
    capsys.readouterr()
    assert cli_main(["report", str(tmp_path / "runs" / "r")]) == 0
    text = html.unescape((tmp_path / "runs" / "r" / "report.html").read_text())
    assert f"Not evaluated here: its data cannot be read ({tmp_path / 'data'}" in text
    assert 'data-chart="loss"' in text


def test_a_masked_patch_prediction_run_reports_its_own_score(tmp_path):
    cfg = load_config(
        "mpp_digits",
        ["schedule.steps=6", f"run.out_dir={tmp_path}", "run.progress=false", "run.threads=1", "run.log_every=2"],
    )
    result = train(cfg, REPORT_HOOKS)
    page = (result.run_dir / "report.html").read_text()
    final = [r for r in records(result.run_dir) if r["kind"] == "eval"][-1]
    headline = page.split('<section id="config">')[0]
    assert f"{100 * final['eval_mpp_acc']:.2f}%" in headline and "masked patch colour accuracy" in headline
    assert 'class="confusion"' not in page and "no class labels to score" in page
    assert "Fig 6:" in page and 'data-chart="loss"' in page  # inspection and curves as for any run


def test_text_in_the_data_cannot_end_the_script():
    page = Page("a </script> title")
    page.add("x", "X", page.chart(Chart("c", "C", [Series("</script><script>alert(1)</script>", [1, 2], [0.5, None])])))
    text = page.render()
    assert "</script><script>alert(1)" not in text and "<title>a &lt;/script&gt; title</title>" in text
    data = text.split('id="report-data">', 1)[1].split("</script>", 1)[0]
    assert json.loads(data)["c"]["series"][0]["name"] == "</script><script>alert(1)</script>"


# ------------------------------------------------------------------------------------------------ browser
@pytest.fixture(scope="module")
def browser() -> str:
    for name in BROWSERS:
        if found := shutil.which(name):
            return found
    pytest.skip("no Chromium or Chrome on this machine (Debian: apt-get install chromium): page not rendered")


def headless(browser: str, tmp_path: Path, *args: str) -> str:
    profile = tmp_path / "profile"
    done = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",  # root in a container
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=5000",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_page_draws_in_a_browser_without_errors(browser, run_dir, tmp_path):
    dom = headless(browser, tmp_path, "--window-size=1280,900", "--dump-dom", (run_dir / "report.html").as_uri())
    root = Elements(dom).all("html")[0]
    errors = dom.split('id="report-errors"', 1)[1].split("</pre>", 1)[0]
    assert root["data-errors"] == "0" and root["data-status"] == "drawn", errors
    elements = Elements(dom)
    charts = [a for a in elements.all("figure") if "data-chart" in a]
    assert len(charts) == 4
    for chart in charts:
        width, height = (int(v) for v in chart["data-box"].split("x"))
        assert width >= 300 and height >= 200, chart
        assert int(chart["data-points"]) >= 1
    loss = next(c for c in charts if c["data-chart"] == "loss")
    assert int(loss["data-points"]) == 6 + 1  # train loss at steps 5..30, the eval loss at 30
    for tag, attrs, hidden in elements.found:
        if tag == "img":
            assert re.fullmatch(r"[1-9]\d*x[1-9]\d*", attrs["data-natural"]), attrs["alt"]
            if not hidden:  # inside a closed <details> an image takes no room
                assert re.fullmatch(r"[1-9]\d*x[1-9]\d*", attrs["data-box"]), attrs["alt"]
    svgs = re.findall(r"<svg [^>]*>", dom)
    assert len(svgs) == 4 and all('width="' in s for s in svgs)


def test_hover_zoom_and_the_policy_in_a_browser(browser, run_dir, tmp_path):
    """The page's own handlers, driven by pointer events; and a request the page must not make, blocked."""
    probe = """<img src="https://example.invalid/tracker.png" alt="">
<script>
(function () {
  var fig = document.querySelector('figure[data-chart="loss"]'), plot = fig.querySelector(".plot");
  var r = plot.getBoundingClientRect(), y = r.top + r.height / 2;
  function send(type, x) {
    plot.dispatchEvent(new PointerEvent(type, {clientX: r.left + x * r.width, clientY: y, button: 0,
      pointerId: 1, bubbles: true}));
  }
  var before = fig.getAttribute("data-view");
  send("pointermove", 0.98);
  var tip = fig.getAttribute("data-tooltip");
  send("pointerdown", 0.4); send("pointermove", 0.8); send("pointerup", 0.8);
  var zoomed = fig.getAttribute("data-view"), reset = fig.querySelector("button.reset").hidden;
  plot.dispatchEvent(new MouseEvent("dblclick", {bubbles: true}));
  document.body.setAttribute("data-probe", JSON.stringify({before: before, tip: tip, zoomed: zoomed,
    resetHidden: reset, after: fig.getAttribute("data-view")}));
})();
</script>"""
    page = tmp_path / "probe.html"
    page.write_text((run_dir / "report.html").read_text().replace("</body>", probe + "\n</body>"))
    dom = headless(browser, tmp_path, "--window-size=1280,900", "--dump-dom", page.as_uri())
    body = Elements(dom).all("body")[0]
    result = json.loads(body["data-probe"])
    assert result["before"] == "5..30" and result["after"] == "5..30"
    assert result["zoomed"] != "5..30" and result["resetHidden"] is False
    lo, hi = (float(v) for v in result["zoomed"].split(".."))
    assert 5 < lo < hi < 30
    assert result["tip"].startswith("step 30") and "train loss" in result["tip"] and "epoch" in result["tip"]
    errors = dom.split('id="report-errors"', 1)[1].split("</pre>", 1)[0]
    assert "blocked by the page's policy: https://example.invalid/tracker.png" in errors


def framed(page: Path, width: int, height: int, out: Path) -> Path:
    """The page inside a frame ``width`` CSS pixels wide (a phone's width: Chromium's headless window is at least
    500 wide); the frame's figures are copied onto the outer page's <html> once it has drawn."""
    outer = f"""<!DOCTYPE html><html><head><meta charset="utf-8"></head><body style="margin:0">
<iframe id="frame" style="border:0;width:{width}px;height:{height}px" srcdoc="{html.escape(page.read_text())}"></iframe>
<script>
document.getElementById("frame").addEventListener("load", function () {{
  var inner = this.contentDocument.documentElement;
  ["data-status", "data-errors", "data-widths"].forEach(function (k) {{
    document.documentElement.setAttribute(k, inner.getAttribute(k));
  }});
  var boxes = [];
  inner.querySelectorAll("figure[data-chart]").forEach(function (f) {{ boxes.push(f.getAttribute("data-box")); }});
  document.documentElement.setAttribute("data-charts", boxes.join(" "));
}});
</script></body></html>"""
    out.write_text(outer)
    return out


@pytest.mark.parametrize("width", [1280, 360])
def test_screenshots_wide_and_narrow(browser, run_dir, tmp_path, width):
    """A desktop window and a phone-wide one: the page draws in both and fits without sideways scrolling."""
    page = framed(run_dir / "report.html", width, 2400, tmp_path / "framed.html")
    window = f"--window-size={max(width, 500)},2400"
    shot = tmp_path / f"report_{width}.png"
    headless(browser, tmp_path, window, f"--screenshot={shot}", page.as_uri())
    image = Image.open(shot)
    assert image.size == (max(width, 500), 2400)
    pixels = np.asarray(image.convert("L"), dtype=np.float64)[:, :width]
    assert pixels.std() > 10  # text and figures, not a blank window
    root = Elements(headless(browser, tmp_path, window, "--dump-dom", page.as_uri())).all("html")[0]
    assert root["data-status"] == "drawn" and root["data-errors"] == "0"
    viewport, page_width = (int(v) for v in root["data-widths"].split())
    assert viewport == width and page_width == viewport
    widths = [int(box.split("x")[0]) for box in root["data-charts"].split()]
    assert len(widths) == 4  # two side by side in a wide window, one to a row in a narrow one
    assert all(min(300, 0.8 * viewport) < w <= viewport for w in widths), widths


# ------------------------------------------------------------------------------------------ during training
def test_training_rewrites_the_page_at_evaluations_and_a_failure_is_a_warning(tmp_path, monkeypatch):
    import vitkit.report.run as report_run

    written: list[tuple[bool, str]] = []
    real = report_run.write_run_report

    def spy(run_dir, out=None, device="auto", during=False):
        path = real(run_dir, out, device, during)
        written.append((during, path.read_text()))
        return path

    monkeypatch.setattr(report_run, "REFRESH_SECONDS", 0.0)  # every evaluation is "long enough" after the last
    monkeypatch.setattr(report_run, "write_run_report", spy)
    args = [
        "schedule.steps=6",
        "schedule.epochs=none",
        "schedule.warmup_steps=1",
        "run.log_every=2",
        "run.eval_every=2",
    ]
    args.append("run.threads=1")
    train(load_config("digits", [*args, f"run.out_dir={tmp_path / 'a'}", "run.progress=false"]), REPORT_HOOKS)
    during = [text for is_during, text in written if is_during]
    assert len(during) == 2  # the evaluations at steps 2 and 4 (the one at 6 is the end's, with the full page)
    for step, text in zip((2, 4), during):
        assert f"Written during training (step {step}," in text and 'data-chart="loss"' in text
        assert 'class="confusion"' not in text and "Fig 6:" not in text  # no model loaded mid-run
    # the final page too goes through write_run_report (the spy writes it with the real function)
    assert [is_during for is_during, _ in written] == [True, True, False]
    final = next(tmp_path.joinpath("a").iterdir()) / "report.html"
    assert "Written during training" not in final.read_text() and 'class="confusion"' in final.read_text()

    def broken(run_dir, out=None, device="auto", during=False):  # mid-run only: the end's page is written
        if during:
            raise OSError("disk full")
        return real(run_dir, out, device, during)

    monkeypatch.setattr(report_run, "write_run_report", broken)
    cfg = load_config("digits", [*args, f"run.out_dir={tmp_path / 'b'}", "run.progress=false"])
    with pytest.warns(UserWarning, match="not rewritten during training: OSError: disk full"):
        result = train(cfg, REPORT_HOOKS)
    assert result.step == 6


# -------------------------------------------------------------------------------------------------- sweeps
SWEEP_METRICS = ["eval_top1", "eval_loss", "train.loss"]
SWEEP_CLAIMS = [
    {"metric": "eval_top1", "higher": {"optim.lr": 0.003}, "lower": {"optim.lr": 0.001}},
    {"metric": "train.loss", "higher": {"optim.lr": 0.001}, "lower": {"optim.lr": 0.003}},
]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    """The tiny digits sweep of test_sweep.py cut to 2 learning rates x 2 seeds of 10 steps (seconds), with the
    pages `vitkit sweep` asks for (each run's, through its training's hooks; the sweep's, once it is tabulated)."""
    from functools import partial

    from test_sweep import _write_spec

    from vitkit.report.sweep import write_sweep_report
    from vitkit.sweep import run_sweep

    tmp = tmp_path_factory.mktemp("sweep")
    spec = _write_spec(
        tmp / "lr.yaml",
        grid={"optim.lr": [0.001, 0.003]},
        metrics=SWEEP_METRICS,
        figure={"x": "optim.lr", "log_x": True},
        overrides=["run.eval_batch_size=512", "schedule.steps=10", "run.save_every=0"],
        claims=SWEEP_CLAIMS,
    )
    out = tmp / "out"
    page = partial(write_sweep_report, write_missing=False)
    result = run_sweep(spec, out, log=lambda line: None, run_hooks=REPORT_HOOKS, page=page)
    assert not result.failed and out / "report.html" in result.files
    return out


def test_a_sweep_page_tabulates_its_runs_and_links_their_pages(sweep_dir, tmp_path, capsys):
    # vitkit sweep's own page: its cells trained with run.plots=false, so their pages are marked missing
    first = (sweep_dir / "report.html").read_text()
    assert first.count("(page missing)") == 8  # 4 runs, in the table and in the list of runs
    # vitkit report SWEEP writes the missing run pages, then links them
    assert cli_main(["report", str(sweep_dir)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {sweep_dir / 'report.html'}"
    page = (sweep_dir / "report.html").read_text()
    elements = Elements(page)
    assert {"http-equiv": "Content-Security-Policy", "content": CSP} in elements.all("meta")
    assert "(page missing)" not in page
    links = [a["href"] for a in elements.all("a") if not a["href"].startswith("#")]
    runs = sorted(d for d in sweep_dir.iterdir() if d.is_dir())
    assert len(runs) == 4 and len(links) == 8
    for href in links:
        assert not re.match(r"^\s*[a-z]+:|^/", href, re.I), href  # relative links only
        target = (sweep_dir / href).resolve()
        assert target.name == "report.html" and target.is_file() and target.parent in runs
        assert "vitkit run" in target.read_text()
    assert {(sweep_dir / h).resolve().parent for h in links} == set(runs)
    # the table against an independent recomputation from each run's config.yaml and metrics.jsonl
    groups: dict[float, dict[str, list[float]]] = {}
    for run in runs:
        lr = float(yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"])
        recs = records(run)
        last_eval = [r for r in recs if r["kind"] == "eval"][-1]
        last_train = [r for r in recs if r["kind"] == "train"][-1]
        found = groups.setdefault(lr, {m: [] for m in SWEEP_METRICS})
        found["eval_top1"].append(last_eval["eval_top1"])
        found["eval_loss"].append(last_eval["eval_loss"])
        found["train.loss"].append(last_train["loss"])
    body = page.split('class="sweep"', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r'<tr><th scope="row">([^<]+)</th>(.*?)</tr>', body)
    assert len(rows) == 2
    for lr_text, cells in rows:
        shown = dict(re.findall(r'<span data-metric="([^"]+)">([^<]+)</span>', cells))
        want = groups[float(lr_text)]
        assert "<td>2</td>" in cells  # n
        for metric, values in want.items():
            mean, std = statistics.fmean(values), statistics.stdev(values)
            assert html.unescape(shown[metric]) == f"{mean:.4g} ± {std:.2g}", metric
    # the figures the sweep drew, embedded
    images = elements.all("img")
    assert len(images) == len(SWEEP_METRICS)
    for img, metric in zip(images, SWEEP_METRICS):
        assert img["src"].startswith("data:image/png;base64,") and img["alt"].startswith(metric)
        png = (sweep_dir / f"{metric.replace('.', '_')}.png").read_bytes()
        assert base64.b64decode(img["src"].split(",", 1)[1]) == png


def test_a_sweep_page_lists_its_claims_as_tested_from_the_runs_own_numbers(sweep_dir):
    """The claims table against scipy's paired t-test on each run's last records, adjusted together by Holm's rule
    (for two claims: the smaller p doubled, the larger no less than that), and the verdict that rule gives."""
    from scipy import stats as scipy_stats

    from vitkit.report.sweep import write_sweep_report

    write_sweep_report(sweep_dir, write_missing=False)
    page = (sweep_dir / "report.html").read_text()
    body = page.split('class="sweep-claims"', 1)[1].split("</table>", 1)[0]
    rows = [re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row) for row in re.findall(r"<tr>(.*?)</tr>", body)][1:]
    last = {"eval_top1": ("eval", "eval_top1"), "train.loss": ("train", "loss")}
    values: dict[tuple[str, float], dict[int, float]] = {}
    for run in sorted(d for d in sweep_dir.iterdir() if d.is_dir()):
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        for metric, (kind, key) in last.items():
            value = [r for r in records(run) if r["kind"] == kind][-1][key]
            values.setdefault((metric, float(cfg["optim"]["lr"])), {})[cfg["run"]["seed"]] = value
    ps = []
    for claim in SWEEP_CLAIMS:
        high, low = (values[claim["metric"], side["optim.lr"]] for side in (claim["higher"], claim["lower"]))
        ps.append(scipy_stats.ttest_rel([high[s] for s in (0, 1)], [low[s] for s in (0, 1)]).pvalue)
    holm = [min(1.0, 2 * min(ps)), max(min(1.0, 2 * min(ps)), max(ps))]
    holm = holm if ps[0] <= ps[1] else holm[::-1]
    assert len(rows) == len(SWEEP_CLAIMS)
    for claim, cells, p, p_holm in zip(SWEEP_CLAIMS, rows, ps, holm):
        metric, said, diff, _, p_text, holm_text, test, verdict = (html.unescape(c) for c in cells)
        assert metric == claim["metric"] and said.startswith(f"optim.lr={claim['higher']['optim.lr']} > ")
        assert (p_text, holm_text) == (f"{p:.2g}", f"{p_holm:.2g}")  # as the page writes them: 2 significant digits
        want = "not shown" if p_holm >= 0.05 else "shown" if float(diff) > 0 else "reversed"
        assert test == "paired (2 seeds)" and re.sub("<[^>]+>", "", verdict) == want


def test_report_of_a_directory_that_is_neither_a_run_nor_a_sweep(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a training run directory or a sweep directory" in err


@pytest.mark.parametrize("width", [1280, 360])
def test_sweep_page_draws_in_a_browser_wide_and_narrow(browser, sweep_dir, tmp_path, width):
    assert cli_main(["report", str(sweep_dir)]) == 0
    page = framed(sweep_dir / "report.html", width, 1800, tmp_path / "framed.html")
    window = f"--window-size={max(width, 500)},1800"
    shot = tmp_path / f"sweep_{width}.png"
    headless(browser, tmp_path, window, f"--screenshot={shot}", page.as_uri())
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float64)[:, :width]
    assert pixels.std() > 10  # text and figures, not a blank window
    root = Elements(headless(browser, tmp_path, window, "--dump-dom", page.as_uri())).all("html")[0]
    assert root["data-status"] == "drawn" and root["data-errors"] == "0"
    viewport, page_width = (int(v) for v in root["data-widths"].split())
    assert viewport == width and page_width == viewport
    dom = headless(browser, tmp_path, "--window-size=1280,900", "--dump-dom", (sweep_dir / "report.html").as_uri())
    drawn = Elements(dom)
    assert drawn.all("html")[0]["data-status"] == "drawn"
    images = drawn.all("img")
    assert len(images) == len(SWEEP_METRICS)
    for img in images:  # every figure decoded and laid out with a size
        assert re.fullmatch(r"[1-9]\d*x[1-9]\d*", img["data-natural"]) and re.fullmatch(
            r"[1-9]\d*x[1-9]\d*", img["data-box"]
        )


def test_a_one_value_per_channel_list_is_not_a_change_from_its_scalar_default():
    from vitkit.report.configs import ConfigDiff

    diff = ConfigDiff({"data.mean": [0.5], "data.std": [0.25]}, {"data.mean": 0.5, "data.std": 0.5}, None, {})
    assert diff.changed() == ["data.std"]


def test_the_run_directory_resolved_from_its_default_is_no_change(tmp_path, monkeypatch):
    """config.yaml stores run.out_dir absolute: the default `runs`, resolved where the run started, is no change;
    another directory is one (against the defaults and against the shipped config alike)."""
    from vitkit.report.configs import config_diff
    from vitkit.train.rundir import with_absolute_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # as when config.yaml is written, in the run directory made there
    stored = with_absolute_paths(load_config("digits"))  # as config.yaml holds it
    assert stored.run.out_dir == str(tmp_path / "runs")
    assert "run.out_dir" not in config_diff(stored).changed()
    elsewhere = with_absolute_paths(load_config("digits", ["run.out_dir=elsewhere/runs-b"]))
    diff = config_diff(elsewhere)
    assert "run.out_dir" in diff.changed() and diff.differs_from_shipped("run.out_dir")
