"""sync/wire/mpi.py: the MPI transport, run under a real ``mpirun`` (Open MPI) with mpi4py.

Each test starts ``mpirun -np K python tests/mpi_progs/PROG.py ...`` as a subprocess; every rank prints one
``RESULT {json}`` line (tests/mpi_progs/common.py) and the test checks those lines and the exit code. Covered:
broadcast of several dtypes (bfloat16, a 0-d and an empty tensor) with checksums equal on every rank; an MPMD
launch with a sub-group of the world in a non-trivial rank order; the batched exchange of the p2p plan (2 senders
x 2 receivers, several pieces per pair, bit-exact); two groups used at once from worker threads; separately
launched jobs joined by connect/accept through ``ompi-server``, and the clear error without it. The GPU-awareness
and connect/accept decisions are pure functions, tested without mpirun.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import require

from miles_hpc.sync.wire.checksum import tensor_checksum
from miles_hpc.sync.wire.mpi import MPIOptions, connect_accept_blocker, detect_gpu_aware

PROGS = Path(__file__).parent / "mpi_progs"
TIMEOUT_S = 60
# MPI.Get_library_version() of a few MPIs
OPEN_MPI = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022"
CRAY_MPICH = "MPI VERSION    : CRAY MPICH version 8.1.28.7 (ANL base 3.4a2)"
MPICH = "MPICH Version:\t4.1.2\nMPICH Release date:\tWed Jun  7 15:22:45 CDT 2023"
MVAPICH = "MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022"


def _has_mpi4py() -> bool:
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


@pytest.fixture
def mpirun() -> list[str]:
    """The mpirun command prefix; skips (fails under MILES_REQUIRE_ALL=1) without mpirun or mpi4py."""
    path = shutil.which("mpirun")
    require(path is not None and _has_mpi4py(), "mpirun and mpi4py (the mpi extra)")
    cmd = [path or "mpirun", "--allow-run-as-root", "--oversubscribe"]
    if not (shutil.which("ssh") or shutil.which("rsh")):
        # Open MPI insists on finding its remote launcher even when every rank is local (containers without ssh)
        cmd += ["--mca", "plm_rsh_agent", shutil.which("false") or "/bin/false"]
    return cmd


def clean_env(**extra: str) -> dict[str, str]:
    """Our environment minus any MPI launch context (a test run under mpirun must not leak it into the child
    jobs), with ``tests/mpi_progs`` importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    return env | extra


def results(output: str) -> list[dict]:
    """The RESULT objects in mpirun's merged output (robust to lines of different ranks running together)."""
    decoder = json.JSONDecoder()
    found = []
    for part in output.split("RESULT ")[1:]:
        obj, _ = decoder.raw_decode(part)
        found.append(obj)
    return found


def run_mpi(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, list[dict], str]:
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=TIMEOUT_S, env=env or clean_env())
    out = proc.stdout + proc.stderr
    return proc.returncode, results(proc.stdout), out


def prog(name: str, *args: str) -> list[str]:
    return [sys.executable, str(PROGS / name), *args]


def expected_sums() -> list[str]:
    sys.path.insert(0, str(PROGS))
    try:
        from common import payloads
    finally:
        sys.path.remove(str(PROGS))
    return [tensor_checksum(t) for t in payloads()]


# ---------------------------------------------------------------------- pure decisions (no mpirun)
@pytest.mark.parametrize(
    ("library", "env", "query", "want"),
    [
        (OPEN_MPI, {}, 0, False),  # Debian's Open MPI: built with the cuda extension, no CUDA support at run time
        (OPEN_MPI, {}, 1, True),
        (OPEN_MPI, {}, None, False),  # no MPIX_Query_cuda_support symbol
        (OPEN_MPI, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, 0, False),  # another MPI's switch does not count
        (CRAY_MPICH, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, None, True),
        (CRAY_MPICH, {}, None, False),
        (MPICH, {"MPICH_GPU_SUPPORT_ENABLED": "0"}, None, False),
        (MPICH, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, None, True),
        (MVAPICH, {"MV2_USE_CUDA": "1"}, None, True),
        (MVAPICH, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, None, False),
        ("Intel(R) MPI Library 2021.10 for Linux* OS", {}, 1, False),  # unknown: stage (always correct)
    ],
)
def test_detect_gpu_aware(library: str, env: dict[str, str], query: int | None, want: bool) -> None:
    assert detect_gpu_aware(library, env, query) is want


def test_connect_accept_blocker() -> None:
    why = connect_accept_blocker(OPEN_MPI, {"OMPI_COMM_WORLD_SIZE": "1"})
    assert why is not None and "ompi-server" in why and "--ompi-server file:" in why and "from_world" in why
    assert connect_accept_blocker(OPEN_MPI, {"OMPI_MCA_pmix_server_uri": "file:/tmp/uri"}) is None
    assert connect_accept_blocker("Open MPI v5.0.3, package: Open MPI", {}) is None  # PRRTE: not this rule
    assert connect_accept_blocker("MPICH Version:\t4.1.2", {}) is None


def test_options_validate() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        MPIOptions(chunk_bytes=2**31)
    with pytest.raises(ValueError, match="timeout_s"):
        MPIOptions(timeout_s=0)


@pytest.mark.process
def test_import_does_not_initialise_mpi() -> None:
    """Importing the module must not import mpi4py (which initialises MPI) in processes that never use it."""
    code = "import sys, miles_hpc.sync.wire.mpi; assert 'mpi4py' not in sys.modules, 'mpi4py imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=TIMEOUT_S, env=clean_env())


# ---------------------------------------------------------------------- under mpirun
@pytest.mark.mpi
@pytest.mark.parametrize("chunk_bytes", [1 << 30, 1000])  # 1000: every big tensor moves as many messages
def test_broadcast_dtypes(mpirun: list[str], chunk_bytes: int) -> None:
    rc, got, out = run_mpi([*mpirun, "-np", "3", *prog("bcast.py", "--chunk-bytes", str(chunk_bytes))])
    assert rc == 0, out
    assert sorted(r["rank"] for r in got) == [0, 1, 2], out
    want = expected_sums()
    for r in got:
        assert r["sums"] == want, f"rank {r['rank']} differs"
        assert r["size"] == 3 and r["device"] == "cpu"


@pytest.mark.mpi
def test_mpmd_world_subgroup(mpirun: list[str]) -> None:
    cmd = [*mpirun, "-np", "2", *prog("mpmd.py", "trainer"), ":", "-np", "2", *prog("mpmd.py", "engine")]
    rc, got, out = run_mpi(cmd)
    assert rc == 0, out
    by_world = {r["world_rank"]: r for r in got}
    assert sorted(by_world) == [0, 1, 2, 3], out
    assert [by_world[w]["role"] for w in range(4)] == ["trainer", "trainer", "engine", "engine"]
    assert all(r["own_size"] == 2 for r in got)  # each role kept its own world
    # group order [0, 3, 2]: world rank 3 is group rank 1, world rank 2 group rank 2; trainer rank 1 is outside
    assert {w: by_world[w].get("group_rank") for w in range(4)} == {0: 0, 1: None, 2: 2, 3: 1}
    want = expected_sums()
    for w in (0, 2, 3):
        assert by_world[w]["sums"] == want and by_world[w]["group_size"] == 3
    assert by_world[0]["back_ok"] is True


@pytest.mark.mpi
@pytest.mark.parametrize("chunk_bytes", [1 << 30, 100])
def test_exchange_pieces(mpirun: list[str], chunk_bytes: int) -> None:
    rc, got, out = run_mpi([*mpirun, "-np", "4", *prog("exchange.py", "--chunk-bytes", str(chunk_bytes))])
    assert rc == 0, out
    receivers = [r for r in got if r["role"] == "receiver"]
    assert sorted(r["rank"] for r in receivers) == [2, 3], out
    for r in receivers:
        assert r["ok"] == [True] * 10, r  # 5 pieces from each of 2 senders, each bit-exact
    assert sorted(r["sent"] for r in got if r["role"] == "sender") == [10, 10]
    ring = [r for r in got if r["role"] == "ring"]
    assert len(ring) == 4 and all(r["ok"] for r in ring), out


@pytest.mark.mpi
def test_worker_threads_two_groups(mpirun: list[str]) -> None:
    rc, got, out = run_mpi([*mpirun, "-np", "3", *prog("threaded.py")])
    assert rc == 0, out
    assert len(got) == 3, out
    want = expected_sums()
    for r in got:
        assert r["thread_multiple"] is True
        assert r["sums"] == want and r["ring_ok"] is True, r


@pytest.mark.mpi
def test_join_separate_launches(mpirun: list[str], tmp_path: Path) -> None:
    """Three mpirun invocations (trainer job of 2 ranks of which only rank 0 joins, engine jobs of 2 and 1 ranks)
    share one ompi-server and join into one group of 4."""
    server = shutil.which("ompi-server")
    require(server is not None, "ompi-server (Open MPI)")
    uri = tmp_path / "uri"
    srv = subprocess.Popen(
        [server or "ompi-server", "--no-daemonize", "--report-uri", str(uri)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=clean_env(),
    )
    jobs: list[subprocess.Popen[str]] = []
    try:
        deadline = time.monotonic() + 20
        while not (uri.exists() and uri.read_text().strip()):
            assert srv.poll() is None and time.monotonic() < deadline, "ompi-server did not report its URI"
            time.sleep(0.05)
        launch = [*mpirun, "--ompi-server", f"file:{uri}"]
        rdv = str(tmp_path / "rendezvous")
        for job, (np, extra) in enumerate([(2, ["self"]), (2, []), (1, [])]):
            cmd = [*launch, "-np", str(np), *prog("join.py", rdv, "wsync", str(job), "3", *extra)]
            jobs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env())
            )
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in jobs]
    finally:
        for p in [*jobs, srv]:  # ours, by handle
            if p.poll() is None:
                p.kill()
                p.wait()
    for job, (p, out) in enumerate(zip(jobs, outs)):
        assert p.returncode == 0, f"job {job}:\n{out}"
    got = [r for out in outs for r in results(out)]
    members = {(r["job"], r["job_rank"]): r for r in got if r.get("member", True)}
    # job 0's rank 0 first, then job 1's two ranks in their order, then job 2
    assert {k: r["rank"] for k, r in members.items()} == {(0, 0): 0, (1, 0): 1, (1, 1): 2, (2, 0): 3}, outs
    assert [r for r in got if r.get("member") is False] == [{"job": 0, "job_rank": 1, "member": False}]
    want = expected_sums()
    assert all(r["sums"] == want and r["size"] == 4 for r in members.values())
    assert members[(0, 0)]["back_ok"] is True
    assert not any((tmp_path / "rendezvous").glob("*.port")), "port files are removed once accepted"


@pytest.mark.mpi
def test_join_without_ompi_server_fails_clearly(mpirun: list[str], tmp_path: Path) -> None:
    """Without a shared ompi-server, Open MPI 4's connect fails and accept hangs: join() raises first."""
    version = subprocess.run(
        [mpirun[0], "--version"], check=False, capture_output=True, text=True, timeout=TIMEOUT_S
    ).stdout
    if not re.search(r"\(Open MPI\) [1-4]\.", version):  # asked of mpirun: importing mpi4py here would init MPI
        pytest.skip(f"not Open MPI <= 4 ({version.strip()!r}): no ompi-server requirement to check")
    rc, got, out = run_mpi([*mpirun, "-np", "1", *prog("join.py", str(tmp_path), "wsync", "1", "2")])
    assert rc != 0
    assert len(got) == 1 and "ompi-server" in got[0]["error"], out


@pytest.mark.mpi
def test_broadcast_and_p2p_over_mpi_to_real_engines(mpirun: list[str], tmp_path: Path) -> None:
    """Two `miles-hpc serve` engines, each under its own mpirun, and a trainer job of 2 ranks, all joined through
    one ompi-server: broadcast (rank 0) and p2p (both ranks) publishes verified by checksums, exactly the
    Publisher cycle of the torch transport."""
    from miles_hpc.models.presets import init_model
    from miles_hpc.rollout.sglang import wait_for_engines

    server = shutil.which("ompi-server")
    require(server is not None, "ompi-server (Open MPI)")
    model = init_model("qwen3", "tiny", tmp_path / "model")
    (tmp_path / "admin").write_text("mpi-admin\n")
    (tmp_path / "admin").chmod(0o600)
    uri, rdv, ports = tmp_path / "uri", tmp_path / "rdv", tmp_path / "ports"
    rdv.mkdir()
    ports.mkdir()
    procs: list[subprocess.Popen[str]] = []
    srv = subprocess.Popen(
        [server or "ompi-server", "--no-daemonize", "--report-uri", str(uri)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=clean_env(),
    )
    procs.append(srv)
    try:
        deadline = time.monotonic() + 20
        while not (uri.exists() and uri.read_text().strip()):
            assert srv.poll() is None and time.monotonic() < deadline, "ompi-server did not report its URI"
            time.sleep(0.05)
        launch = [*mpirun, "--ompi-server", f"file:{uri}", "-np"]
        for i in range(2):
            serve = [
                sys.executable,
                "-m",
                "miles_hpc.cli",
                "serve",
                str(model),
                "--port",
                "0",
                "--rendezvous",
                str(rdv / f"engine-{i}.json"),
                "--dtype",
                "bfloat16",
                "--admin-api-key-file",
                str(tmp_path / "admin"),
                "--weight-update-timeout",
                "60",
            ]
            procs.append(
                subprocess.Popen(
                    [*launch, "1", *serve],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=clean_env(OMP_NUM_THREADS="1"),
                )
            )
        urls = [r.url for r in wait_for_engines(rdv, 2, timeout=120, poll_s=0.1)]
        trainer = [*launch, "2", *prog("publish.py", str(model), str(ports), "mpi-admin", *urls)]
        proc = subprocess.run(trainer, check=False, capture_output=True, text=True, timeout=240, env=clean_env())
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    got = {r["rank"]: r for r in results(proc.stdout)}
    assert got[0]["broadcast_v1_ok"] and got[0]["broadcast_v2_ok"], out[-3000:]
    assert got[0]["p2p_ok"] and got[0]["versions"] == ["3", "3"], out[-3000:]
    assert got[0]["p2p_pieces"] > 0 and got[1]["pushes"] == 1
    assert not any(ports.glob("*.port")), "port files are removed once accepted"


# ---------------------------------------------------------------------- GPU tier
@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.parametrize("gpu_aware", ["auto", "no"])
def test_broadcast_cuda(mpirun: list[str], gpu_aware: str) -> None:
    """CUDA tensors: passed to MPI directly when it is GPU-aware, else staged through pinned host memory."""
    cmd = [*mpirun, "-np", "3", *prog("bcast.py", "--device", "cuda", "--gpu-aware", gpu_aware)]
    rc, got, out = run_mpi(cmd)
    assert rc == 0, out
    want = expected_sums()
    assert len(got) == 3 and all(r["sums"] == want and r["device"].startswith("cuda") for r in got), out
