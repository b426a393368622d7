"""One self-contained HTML page per run: ``vitkit report RUN`` (and ``vitkit train`` at the end of a run).

The page needs nothing but itself: style, script and images are inline and its Content-Security-Policy lets
nothing be fetched. The pieces are kept apart so that a page of many runs (a sweep) is made of the same ones:
``html`` (tables, images, interactive charts, the page), ``configs`` (what a config changes),
``curves`` (a run's training curves), ``evaluation`` (confusion matrix, worst images), ``environment``;
``run`` assembles the page of one run.
"""

from .html import Chart, Page, Series
from .run import REPORT_NAME, run_report, write_run_report

__all__ = ["REPORT_NAME", "Chart", "Page", "Series", "run_report", "write_run_report"]
