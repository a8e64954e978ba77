"""DiLoCo (chapter 11): with sync_every=1, SGD inside, outer lr 1 and no momentum it is DDP;
after every sync all ranks hold identical parameters; one allreduce of the parameters per
round. World sizes 1, 2, 3; float64, 6 steps: equal means within 1e-12."""
import pytest
import torch

import comm_workers
from dpcourse.launch import launch

WORLDS = (1, 2, 3)


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return {w: launch(comm_workers.diloco_checks, world_size=w, backend="gloo", timeout=300)
            for w in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
def test_diloco_syncing_every_step_with_plain_sgd_is_ddp(runs, world):
    for r in runs[world]:
        for key, value in r["ddp"].items():
            torch.testing.assert_close(r["as_ddp"][key], value, rtol=0, atol=1e-12, msg=key)


@pytest.mark.parametrize("world", WORLDS)
def test_after_every_sync_every_rank_holds_the_same_parameters(runs, world):
    first = runs[world][0]["synced"]
    assert len(first) == comm_workers.STEPS // 3 == runs[world][0]["syncs"]
    for r in runs[world][1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["synced"], first))


@pytest.mark.parametrize("world", WORLDS)
def test_each_sync_sends_the_parameters_once(runs, world):
    r = runs[world][0]
    assert r["bytes_sent"] == r["syncs"] * 8 * r["numel"]


def test_diloco_refuses_bad_settings_and_a_missing_group():
    from torch import nn
    from dpcourse.local_sgd import DiLoCo
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="needs the default process group"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
