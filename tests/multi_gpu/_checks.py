"""Checks every multi-rank test module shares: an expected error, no failed rank."""

from __future__ import annotations


def expect_error(make, exc_type, fragment) -> dict:
    """Run ``make``; it must raise ``exc_type`` whose message contains ``fragment``."""
    try:
        make()
    except exc_type as exc:
        if fragment not in str(exc):
            raise AssertionError(f"error lacks {fragment!r}: {exc}") from exc
        return {"raised": type(exc).__name__, "message": str(exc)}
    raise AssertionError(f"no {exc_type.__name__} raised (expected one mentioning {fragment!r})")


def assert_no_rank_failed(world: int, per_rank: list[dict], name: str) -> None:
    """Every rank's report of case ``name`` is a result, not an exception."""
    for rank, report in enumerate(per_rank):
        assert "error" not in report, (f"W={world} rank {rank} {name}: {report.get('type')}: "
                                       f"{report.get('error')}\n{report.get('traceback', '')}")
