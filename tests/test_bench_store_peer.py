"""`hwr bench --vllm-omni`: the vLLM-Omni reference store as a peer row beside this runtime's (X03)."""

from __future__ import annotations

from pathlib import Path

from hwr_tools.bench.store_peer import (
    HWR,
    REFERENCE,
    StorePeerOptions,
    reference_unavailable_reason,
    run_store_peer_bench,
    store_peer_markdown,
)


def test_both_stores_publish_and_lease_the_same_tensors_in_fresh_processes(tmp_path: Path) -> None:
    """X03: one round on the same seeded tensors: each store builds, hits, and its two holders share one copy."""
    assert reference_unavailable_reason() is None, "vllm-omni==0.30.0 is a test dependency (make setup)"
    data = run_store_peer_bench(StorePeerOptions(size_mib=2, rounds=1, workers=2, workdir=tmp_path))
    rows = data["rows"]
    assert set(rows) == {HWR, REFERENCE}
    for row in rows.values():
        assert row["publish_s"]["median"] > 0 and row["warm_s"]["median"] > 0
        # Two holders of one mapped copy: their PSS adds up to one copy of the weights (page rounding aside).
        assert 0.9 <= row["pss_copies"]["median"] <= 1.1
    table = store_peer_markdown(data)
    assert HWR in table and REFERENCE in table
    assert list(tmp_path.iterdir()) == []  # every round's domain was removed
