"""Checks every multi-rank test module shares: an expected error, no failed rank, relative
errors within their bounds."""

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


def worst_errors_within(world: int, name: str, per_rank: list[dict], *, forward: str,
                        forward_rtol: float, grad_rtol: float) -> str:
    """Every rank's ``report["errors"]`` (``{what: relative error}``) within its bound (an
    output's, ``what`` starting with ``forward``, or a gradient's); the worst of each, as
    one line."""
    assert_no_rank_failed(world, per_rank, name)
    worst = {}
    for report in per_rank:
        for what, err in report["errors"].items():
            worst[what] = max(worst.get(what, 0.0), err)
            bound = forward_rtol if what.startswith(forward) else grad_rtol
            assert err <= bound, f"W={world} {name}: {what} relative error {err:.3g} > {bound}"
    return "worst relative errors " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
