"""mkdocs hook: the benchmark results (benchmarks/results/*.md) as pages of the site.

The pages link to a result as a code host shows it, `../benchmarks/results/NAME.md`; this hook adds each file under
that source path (outside docs/, so mkdocs would not find it) and builds it at `benchmarks/results/NAME/`, so the
links work in the built site too and `mkdocs build --strict` checks them like any other.
"""

from __future__ import annotations

import os
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for path in sorted(RESULTS.glob("*.md")):
        dest = "benchmarks/results/" + ("index.html" if path.stem == "README" else f"{path.stem}/index.html")
        if not config.use_directory_urls:
            dest = "benchmarks/results/" + ("index.html" if path.stem == "README" else f"{path.stem}.html")
        files.append(
            File(
                Path(os.path.relpath(path, config.docs_dir)).as_posix(),
                src_dir=config.docs_dir,
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
                dest_uri=dest,
                inclusion=InclusionLevel.NOT_IN_NAV,
            )
        )
    return files
