"""benchmarks/published.py: the table lists every published figure, and the step-time model's default variant (no
overlap) reproduces every compared figure within the stated tolerance."""
import pytest


@pytest.fixture(scope="module")
def published(benchmark_module):
    return benchmark_module("published")


def test_the_table_lists_every_published_figure_with_its_setting_and_source(published):
    out = published.format_validation()
    for figure in published.FIGURES:
        assert figure.name in out and figure.source in out and figure.setting in out
        assert figure.predict is not None or figure.reason in out


def test_the_default_variant_reproduces_every_compared_figure_within_the_tolerance(published):
    compared = [(figure, value) for figure, value in published.validation_rows(overlap=False) if value is not None]
    assert len(compared) == 8  # 4 at 400 Gbps, 2 at 100 Gbps, 2 at 200 against 800
    for figure, value in compared:
        assert abs(figure.relative_error(value)) <= published.TOLERANCE, (figure.name, value)
