"""DiLoCo (chapter 11): with sync_every=1, SGD inside, outer lr 1 and no momentum it is DDP;
after every sync all ranks hold identical parameters; one allreduce of the parameters per
round; and every outer step is SGD with (Nesterov) momentum written out by hand on the ranks'
mean pseudo-gradient, over several rounds. World sizes 1, 2, 3; float64, 6 steps: equal means
within 1e-12."""
import pytest
import torch
import torch.distributed as dist

import comm_workers
from dpcourse.launch import launch
from dpcourse.local_sgd import DiLoCo

WORLDS = (1, 2, 3)
SYNC_EVERY, ROUNDS = 2, 3
OUTER = {"defaults": {},  # lr 0.7, Nesterov momentum 0.9
         "plain momentum": {"outer_lr": 0.5, "outer_momentum": 0.6, "nesterov": False}}
DEFAULTS = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}


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


def flat(model: torch.nn.Module) -> torch.Tensor:
    """The model's parameters, one vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def outer_round_ends(settings: dict) -> dict[str, list[torch.Tensor]]:
    """On a rank: ROUNDS rounds of SYNC_EVERY inner SGD steps on this rank's share under
    DiLoCo(**settings); the parameters just before each sync and just after it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = comm_workers.net(rank)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.2), SYNC_EVERY, **settings)
    inner, after = [], []
    opt.inner.register_step_post_hook(lambda *_: inner.append(flat(model)))
    comm_workers.train(model, opt, SYNC_EVERY * ROUNDS, rank, world,
                       after_step=lambda: after.append(flat(model)))
    last = slice(SYNC_EVERY - 1, None, SYNC_EVERY)  # each round's last step: the sync
    return {"before": inner[last], "after": after[last]}


def outer_rounds() -> dict[str, dict[str, list[torch.Tensor]]]:
    """On a rank: outer_round_ends for each OUTER setting."""
    return {name: outer_round_ends(settings) for name, settings in OUTER.items()}


def outer_sgd_by_hand(start: torch.Tensor, before: list[list[torch.Tensor]], outer_lr: float,
                      outer_momentum: float, nesterov: bool) -> list[torch.Tensor]:
    """The parameters after each outer step; before[rank][round]: a rank's just before it.
    torch's SGD (dampening 0, no weight decay): g = start - the ranks' mean, b = mu b + g
    (b = g at the first step), p = start - lr (g + mu b) with Nesterov, start - lr b without."""
    p, b, after = start, None, []
    for currents in zip(*before):
        g = p - sum(currents) / len(currents)
        b = g if b is None else outer_momentum * b + g
        p = p - outer_lr * (g + outer_momentum * b if nesterov else b)
        after.append(p)
    return after


@pytest.fixture(scope="module")
def outer_runs() -> list[dict]:
    return launch(outer_rounds, world_size=3, backend="gloo", timeout=300)


@pytest.mark.parametrize("name", OUTER)
def test_every_outer_step_is_momentum_sgd_by_hand_on_the_ranks_mean(outer_runs, name):
    """Three ranks on different data, three rounds (the momentum carried across them)."""
    before = [r[name]["before"] for r in outer_runs]
    assert not torch.equal(before[0][0], before[1][0])  # the mean is over different ranks
    want = outer_sgd_by_hand(flat(comm_workers.net(0)), before, **{**DEFAULTS, **OUTER[name]})
    for r in outer_runs:
        assert len(r[name]["after"]) == ROUNDS
        for round_, (got, p) in enumerate(zip(r[name]["after"], want)):
            torch.testing.assert_close(got, p, rtol=0, atol=1e-12, msg=f"round {round_}")
