"""A pytest plugin that ``scripts/test.sh`` loads (``-p skip_reasons``): one line, before pytest's short summary and
its final counts (which stay the last line), saying why tests were skipped, most frequent reason first:

    skipped: 1790 needs a CUDA device (fused LoCo kernels), 11 transformers is not installed (pip install ".[hf]")
"""
import collections


def skip_reason(report) -> str:
    """The reason a skipped test report gives, without pytest's ``Skipped: `` prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def skip_line(reports) -> str:
    """``skipped: N reason, M reason``, most frequent first (ties in the order first seen); "" for no reports."""
    counts = collections.Counter(skip_reason(report) for report in reports)
    return "skipped: " + ", ".join(f"{count} {reason}" for reason, count in counts.most_common()) if counts else ""


def pytest_terminal_summary(terminalreporter) -> None:
    line = skip_line(terminalreporter.stats.get("skipped", []))
    if line:
        terminalreporter.write_line(line)
