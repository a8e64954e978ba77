"""launch: values in rank order, clear errors for failing and hanging ranks, no process left."""
import collections
import multiprocessing as mp
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import workers
from dpcourse.launch import LaunchTimeoutError, RankError, choose_backend, launch
from dpcourse.resume import to_cpu

try:
    import psutil
except ImportError:  # psutil is a test extra; multiprocessing's own view still applies
    psutil = None


def children_left() -> list[str]:
    """This process's child processes, except multiprocessing's resource tracker and the
    forkserver that launch starts once (both end with this process; the ranks it forks, which
    share its command line, still count)."""
    names = [repr(p) for p in mp.active_children()]
    server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if psutil is not None:
        for child in psutil.Process().children(recursive=True):
            try:
                cmd, zombie = " ".join(child.cmdline()), child.status() == psutil.STATUS_ZOMBIE
            except psutil.Error:
                continue  # it ended meanwhile
            if not (zombie or child.pid == server or "resource_tracker" in cmd):
                names.append(cmd)
    return names


def launch_dirs() -> set:
    """The temporary directories of launches (each launch removes its own)."""
    return set(Path(tempfile.gettempdir()).glob("dpcourse-launch-*"))


@pytest.fixture
def own_tempdir(tmp_path, monkeypatch) -> None:
    """Launches in this test make their folders in tmp_path, apart from any other run's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_two_launches_at_once_each_return_values_in_rank_order(capsys, own_tempdir):
    results = {}
    worlds = {"a": 3, "b": 2}

    def run(tag: str) -> None:
        try:
            results[tag] = launch(workers.whoami, tag, world_size=worlds[tag], backend="gloo",
                                  timeout=120)
        except BaseException as exc:  # noqa: BLE001 - reported by the test, not the thread
            results[tag] = exc
    threads = [threading.Thread(target=run, args=(tag,)) for tag in worlds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    for tag, world in worlds.items():
        values = results[tag]
        assert isinstance(values, list), f"launch {tag} failed: {values!r}"
        assert [(v["rank"], v["world"], v["tag"]) for v in values] == [
            (rank, world, tag) for rank in range(world)]
        assert [v["tensor"].tolist() for v in values] == [[2.0 * r] * 2 for r in range(world)]
        assert all(v["threads"] == 1 and v["omp"] == "1" for v in values)  # 1 thread per rank
        assert {v["device"] for v in values} == {"cpu"}  # gloo: every rank on the CPU
    printed = capsys.readouterr().out  # what the ranks printed, replayed rank by rank
    assert printed.index("rank 0 says a") < printed.index("rank 1 says a") < printed.index(
        "rank 2 says a")
    assert children_left() == []
    assert launch_dirs() == set()


def test_arguments_travel_by_value_each_rank_its_own_copy_of_only_the_elements_passed():
    whole = torch.arange(4000.0).reshape(1000, 4)
    alone, layer = torch.zeros(3), nn.Linear(4, 2)
    weight = layer.weight.detach().clone()
    sent = [alone, whole[:256], whole[:, 1], whole.t(), layer.weight]  # slices, a Parameter
    seen = launch(workers.add_own_rank, sent, world_size=3, backend="gloo", timeout=120)
    for rank, tensors in enumerate(seen):
        for arg, got in zip(sent, tensors, strict=True):
            assert torch.equal(got["value"], arg.detach() + rank + 1)  # its own copy
            assert got["storage_bytes"] == arg.numel() * arg.element_size()  # not whole's
            assert not got["shared"]
    assert torch.equal(alone, torch.zeros(3)) and torch.equal(layer.weight, weight)
    assert torch.equal(whole, torch.arange(4000.0).reshape(1000, 4))
    assert not any(t.is_shared() for t in (alone, whole, layer.weight))


def test_a_result_keeps_its_containers_and_each_tensor_owns_its_memory():
    whole = torch.arange(10.0, requires_grad=True)
    point = collections.namedtuple("Point", "x y")
    state = nn.BatchNorm1d(2).state_dict()  # an OrderedDict with _metadata
    value = {"state": state, "lists": collections.defaultdict(list, a=[whole[:2]]),
             "point": point(whole[2:3], (whole[3:5],))}
    back = to_cpu(value)
    assert type(back["state"]) is type(state) and back["state"]._metadata == state._metadata
    assert back["lists"].default_factory is list and type(back["point"]) is point
    for got, arg in [(back["lists"]["a"][0], whole[:2]), (back["point"].x, whole[2:3]),
                     (back["point"].y[0], whole[3:5])]:
        assert torch.equal(got, arg.detach()) and not got.requires_grad
        assert got.untyped_storage().nbytes() == arg.numel() * arg.element_size()


def test_an_argument_pickle_cannot_send_gets_a_clear_error():
    with pytest.raises(ValueError, match="cannot send the arguments of .*whoami"):
        launch(workers.whoami, lambda: 1)
    assert children_left() == []


def test_a_raising_rank_is_named_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(workers.fail_on, 1, backend="gloo", timeout=60)
    assert time.monotonic() - start < 60
    assert info.value.rank == 1
    message = str(info.value)
    assert message.startswith("rank 1 of 2 raised ValueError: deliberate failure on rank 1")
    assert "Traceback" in message and "in fail_on" in message
    assert children_left() == []
    # the next launch, right after, starts afresh (and threads is honoured)
    assert launch(workers.whoami, "again", world_size=1, threads=2)[0]["threads"] == 2


def test_ranks_see_the_environment_and_folder_of_the_launch_not_of_the_forkserver(
        tmp_path, monkeypatch):
    launch(workers.whoami, "start the forkserver", world_size=1)  # before the changes below
    monkeypatch.setenv("DPCOURSE_SET_AFTER_THE_SERVER", "seen")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.chdir(tmp_path)
    seen = launch(workers.surroundings, "DPCOURSE_SET_AFTER_THE_SERVER", backend="gloo",
                  threads=None)
    assert [(s["value"], s["omp"], s["threads"], s["cwd"]) for s in seen] == \
        [("seen", "3", 3, str(tmp_path))] * 2
    [one] = launch(workers.surroundings, "OMP_NUM_THREADS", world_size=1)
    assert (one["omp"], one["threads"]) == ("1", 1)


def test_ranks_are_forked_from_the_forkserver_on_linux_and_spawned_elsewhere(monkeypatch):
    [forked] = launch(workers.surroundings, "HOME", world_size=1)
    assert forked["parent"] == multiprocessing.forkserver._forkserver._forkserver_pid
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setenv("DPCOURSE_SET_FOR_SPAWN", "seen")
    spawned = launch(workers.surroundings, "DPCOURSE_SET_FOR_SPAWN", backend="gloo")
    assert [(s["value"], s["parent"]) for s in spawned] == [("seen", os.getpid())] * 2
    assert children_left() == []


def test_ranks_end_without_python_shutdown_where_gloo_threads_could_abort_them(tmp_path):
    # torch keeps a destroyed gloo group's threads alive until shutdown once an optimizer
    # exists; shutting down with them can abort a rank (SIGABRT) after its result is saved
    at_exit = tmp_path / "at-exit-of-rank-"
    assert launch(workers.optimizer_and_atexit, str(at_exit), backend="gloo") == [0, 1]
    assert list(tmp_path.iterdir()) == []


def test_what_a_rank_prints_from_c_is_replayed_too(capsys, monkeypatch):
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # C's stdout: buffered in the file
    assert launch(workers.print_from_c, "printf reached the parent", backend="gloo") == [0, 1]
    assert capsys.readouterr().out.count("printf reached the parent") == 2


def test_a_ranks_own_child_processes_end_with_it():
    [pid] = launch(workers.start_a_sleeper, world_size=1, backend="gloo")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.skipif(psutil is None, reason="needs psutil to follow the processes")
def test_a_killed_launcher_leaves_no_rank_or_helper_behind(tmp_path):
    # forked ranks keep the forkserver alive: they must watch the launcher itself
    script = ("import sys, workers; from dpcourse.launch import launch; "
              f"launch(workers.note_pid_and_sleep, {str(tmp_path)!r}, backend='gloo', "
              "timeout=300)")
    launcher = subprocess.Popen([sys.executable, "-c", script], cwd=Path(workers.__file__).parent)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        family = psutil.Process(launcher.pid).children(recursive=True)
        ranks = {int(f.read_text()) for f in tmp_path.glob("rank*.pid")}
        assert len(ranks) == 2 and ranks <= {p.pid for p in family}
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10
    while (running := [p for p in family if runs(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running == [], f"still running 10 s after the launcher was killed: {running}"


def runs(process: "psutil.Process") -> bool:
    """Whether process still runs (an orphan's zombie waits for whoever reaps it: it has ended)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_hanging_rank_ends_in_a_timeout_error_naming_the_running_ranks():
    timeout = 8.0
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError, match="timed out after 8 s") as info:
        launch(workers.hang_on, 1, backend="gloo", timeout=timeout)
    assert time.monotonic() - start < timeout + 6
    assert info.value.ranks == [0, 1]  # rank 1 sleeps, rank 0 waits for it in all_reduce
    assert isinstance(info.value, TimeoutError)
    assert children_left() == []


def test_ctrl_c_stops_every_rank():
    def ctrl_c(*_):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGALRM, ctrl_c)
    signal.setitimer(signal.ITIMER_REAL, 6.0)  # "Ctrl-C" 6 s into a launch that would hang
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(workers.hang_on, 0, world_size=1, timeout=60)  # rank 0 sleeps
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert children_left() == []


def test_a_notebook_function_gets_a_clear_error(monkeypatch):
    notebook_main = types.ModuleType("__main__")  # like Jupyter's: no file to import it from
    monkeypatch.setitem(sys.modules, "__main__", notebook_main)

    def hello():
        return 1
    hello.__module__ = "__main__"
    with pytest.raises(ValueError, match="defined in a notebook.*importable|import"):
        launch(hello)
    with pytest.raises(ValueError, match="cannot send"):
        launch(lambda: 1)


def test_bad_arguments_and_backends():
    with pytest.raises(ValueError, match="world_size"):
        launch(workers.whoami, "x", world_size=0)
    with pytest.raises(ValueError, match="threads"):
        launch(workers.whoami, "x", threads=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="nccl needs one GPU per rank"):
            launch(workers.whoami, "x", backend="nccl")
    with pytest.raises(ValueError, match="backend"):
        choose_backend(2, "mpi")


def test_choose_backend_says_when_it_falls_back_to_gloo(capsys):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = choose_backend(gpus + 1)
    assert backend == "gloo"
    assert capsys.readouterr().out == (
        f"launch: {gpus + 1} rank{'s' if gpus else ''}, {gpus} GPU{'' if gpus == 1 else 's'}: "
        "gloo backend, every rank on the CPU\n")
    assert choose_backend(2, "gloo") == "gloo" and capsys.readouterr().out == ""
