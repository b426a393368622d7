"""One self-contained HTML page per run or sweep: ``vitkit report PATH`` (``write_report``); ``vitkit train`` writes
a run's at its end and at evaluations (the command line passes ``run.REPORT_HOOKS`` to the training), ``vitkit
sweep`` a sweep's. ``run`` and ``sweep`` assemble their pages from the same pieces (``html`` and the other modules).
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
