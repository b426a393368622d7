"""One self-contained HTML page per run or sweep: ``vitkit report PATH`` (``write_report``); ``vitkit train`` writes
a run's at its end and at evaluations of a long run (the command line passes ``run.REPORT_HOOKS`` to the training,
which imports no report), ``vitkit sweep`` a sweep's and its runs'.

The page needs nothing but itself: style, script and images are inline and its Content-Security-Policy lets
nothing be fetched. The pieces are kept apart so that a page of many runs (a sweep) is made of the same ones:
``html`` (tables, images, interactive charts, the page), ``configs`` (what a config changes),
``curves`` (a run's training curves), ``evaluation`` (confusion matrix, worst images), ``environment``;
``run`` assembles the page of one run, ``sweep`` that of a sweep (its table, figures and links to its runs' pages).
"""

from .html import Chart, Page, Series
from .run import REPORT_NAME, run_report, write_run_report
from .sweep import is_sweep_dir, sweep_report, write_report, write_sweep_report

__all__ = [
    "REPORT_NAME",
    "Chart",
    "Page",
    "Series",
    "is_sweep_dir",
    "run_report",
    "sweep_report",
    "write_report",
    "write_run_report",
    "write_sweep_report",
]
