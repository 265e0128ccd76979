"""CPU lists and pinning (sluice.cpu_placement), and the engine's --cpus: the list read and
refused, and an engine whose every thread runs on the CPUs it was given."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from sluice.cpu_placement import allowed_cpus, check_cpus, format_cpu_list, parse_cpu_list, physical_cores


def _two_cpus() -> list[int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("pinning to one CPU of several needs two CPUs; this machine gives one")
    return cpus


def test_cpu_lists_read_as_linux_writes_them():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list(" 5 , 2-3,3") == [2, 3, 5]  # sorted, each once, spaces allowed
    assert parse_cpu_list("7") == [7]
    assert format_cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert format_cpu_list({4}) == "4"
    for cpus in ([0], [1, 3, 5], list(range(12)), [2, 3, 9, 10, 11, 40]):
        assert parse_cpu_list(format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize(("text", "says"), [
    ("", "empty"), ("  ", "empty"), ("a", "'a' is not a CPU number"), ("1-", "'1-' is not"),
    ("-1", "'-1' is not"), ("3-1", "'3-1' is not a range"), ("0,,1", "'' is not"), ("1.5", "'1.5'"),
    ("+1", "'+1' is not"), ("1_0", "'1_0' is not"), ("\u0663", "is not a CPU number"),
    ("0-70000", "names a CPU above 65535"), ([0, 1], "is text such as '0-3,8', not list"),
    (3, "not int 3"),
])
def test_a_list_that_names_no_cpus_is_refused_saying_why(text, says):
    with pytest.raises(ValueError, match="^--cpus: ") as err:
        check_cpus(text, "--cpus")
    assert says in str(err.value)


def test_cpus_this_process_may_not_use_are_refused():
    allowed = allowed_cpus()
    beyond = max(allowed) + 1
    with pytest.raises(ValueError, match=f"--cpus: CPU {beyond} is not this process's to use"):
        check_cpus(f"{min(allowed)},{beyond}", "--cpus")
    assert check_cpus(format_cpu_list(allowed), "--cpus") == allowed


def _topology(root, cores: list[list[int]], name: str = "core_cpus_list"):
    """A sysfs CPU tree where each of ``cores`` lists its CPUs as sharing it."""
    for core in cores:
        for cpu in core:
            where = root / f"cpu{cpu}" / "topology"
            where.mkdir(parents=True)
            (where / name).write_text(format_cpu_list(core) + "\n")
    return root


def test_cpus_group_by_physical_core(tmp_path):
    """A core's SMT siblings go together, in the order of their first CPU, as Linux lists them
    (core_cpus_list; thread_siblings_list before 5.7); a CPU Linux shows no topology for is a
    core of its own."""
    root = _topology(tmp_path / "new", [[0, 2], [1, 3], [4, 5]])
    assert physical_cores([0, 1, 2, 3, 4, 5, 9], root) == [[0, 2], [1, 3], [4, 5], [9]]
    assert physical_cores([3, 5], root) == [[3], [5]]
    old = _topology(tmp_path / "old", [[0, 1], [2, 3]], name="thread_siblings_list")
    assert physical_cores([0, 1, 2, 3], old) == [[0, 1], [2, 3]]


def test_reserved_cpus_take_whole_cores(tmp_path, monkeypatch, capsys):
    """--reserved-cpus 1 on a machine of two-thread cores reserves a core's both CPUs, and the
    engine gets no sibling of theirs; what would leave the engine no core is refused."""
    from engine_service.config import EngineConfig
    from sluice_cli import serve

    root = _topology(tmp_path, [[0, 2], [1, 3]])
    monkeypatch.setattr(serve, "usable_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(serve, "physical_cores", lambda cpus: physical_cores(cpus, root))
    config = EngineConfig()
    assert serve._reserve_cpus(1, config, own_redis=True) == [0, 2]
    assert config.cpus == "1,3"
    assert "Redis and the gateway on CPUs 0,2, the engine on 1,3" in capsys.readouterr().err
    assert serve._reserve_cpus(0, EngineConfig(), own_redis=True) is None
    with pytest.raises(ValueError, match="--reserved-cpus must be from 0 to 2 here"):
        serve._reserve_cpus(3, EngineConfig(), own_redis=True)
    serve._reserve_cpus(2, config := EngineConfig(), own_redis=False)
    assert config.cpus == "1,3" and "the gateway on CPUs 0,2" in capsys.readouterr().err


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_pinned_moves_every_thread_and_puts_them_back():
    """Threads started before the block are moved too (Linux pins one thread at a time), threads
    started inside it inherit the CPUs, and all go back afterwards."""
    cpus = _two_cpus()
    got = _run(f"""
        import os, threading
        from pathlib import Path
        from sluice.cpu_placement import pinned

        def masks():
            return sorted({{tuple(sorted(os.sched_getaffinity(int(t.name)))) for t in
                            Path(f"/proc/{{os.getpid()}}/task").iterdir()}})

        stop = threading.Event()
        early = threading.Thread(target=stop.wait); early.start()
        with pinned([{cpus[-1]}]):
            late = threading.Thread(target=stop.wait); late.start()
            print(masks())
        print(masks())
        stop.set()
        """)
    inside, after = got.splitlines()
    assert inside == str([(cpus[-1],)])
    assert after == str([tuple(cpus)])


@pytest.mark.model
def test_an_engine_given_cpus_runs_every_thread_there_with_a_compute_thread_each(model_dir):
    """A thread the process had before the engine is moved, the engine's own threads start there,
    torch computes with one thread, and it decodes."""
    cpus = _two_cpus()
    got = _run(f"""
        import os, threading, torch
        from pathlib import Path
        from engine_service import LLM, SamplingParams

        stop = threading.Event()
        early = threading.Thread(target=stop.wait); early.start()
        llm = LLM({str(model_dir)!r}, cpus="{cpus[-1]}", kv_cache_memory=64 << 20)
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
        tasks = list(Path(f"/proc/{{os.getpid()}}/task").iterdir())
        print(len(out[0].outputs[0].token_ids), torch.get_num_threads(), sorted(os.sched_getaffinity(early.native_id)),
              sorted({{tuple(sorted(os.sched_getaffinity(int(t.name)))) for t in tasks}}))
        stop.set()
        """)
    tokens, threads, early, masks = got.strip().split(" ", 3)
    assert (tokens, threads, early) == ("4", "1", f"[{cpus[-1]}]")
    assert masks == str([(cpus[-1],)])


def test_an_engine_that_fails_to_start_puts_the_process_back(tmp_path):
    """LLM(cpus=...) pins the calling process; an engine that then fails (no model there) leaves its
    CPUs and torch's thread count as they were."""
    cpus = _two_cpus()
    got = _run(f"""
        import os, torch
        from engine_service import LLM

        torch.set_num_threads(2)
        try:
            LLM({str(tmp_path / "no-model")!r}, cpus="{cpus[-1]}")
        except Exception as exc:
            print(type(exc).__name__, sorted(os.sched_getaffinity(0)), torch.get_num_threads())
        """)
    assert got.split(" ", 1)[1].strip() == f"{cpus} 2"


def test_cpus_the_kernel_narrows_or_refuses_leave_every_thread_where_it_was():
    """A list with a CPU that is not online: Linux keeps the ones that are, and pin_process, reading
    the mask back, says so and puts back every thread it had moved; a list of none online: Linux
    refuses it (EINVAL), and pin_process says that."""
    cpus = _two_cpus()
    got = _run(f"""
        import os, threading
        from sluice.cpu_placement import pin_process

        stop = threading.Event()
        early = threading.Thread(target=stop.wait); early.start()
        for cpus in ([{cpus[-1]}, 65535], [65535]):
            try:
                pin_process(cpus)
            except ValueError as exc:
                print(exc)
            print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(early.native_id)))
        stop.set()
        """)
    narrowed, masks, refused, masks_after = got.strip().splitlines()
    assert narrowed == f"the kernel gave CPUs {cpus[-1]} of the {cpus[-1]},65535 asked for (a cpuset narrower than " \
                       "the list?)"
    assert refused.startswith("CPUs 65535: the kernel refused them (Invalid argument")
    assert masks == masks_after == f"{cpus} {cpus}"


def test_an_engine_refuses_cpus_it_may_not_use_before_loading_anything():
    from engine_service import LLM

    with pytest.raises(ValueError, match="^cpus: CPU"):
        LLM("/nonexistent-model-dir", cpus=str(max(allowed_cpus()) + 1))
    with pytest.raises(ValueError, match="^cpus: 'x' is not"):
        LLM("/nonexistent-model-dir", cpus="x")


def test_sluice_engine_exits_2_naming_cpus():
    out = subprocess.run([sys.executable, "-m", "sluice_cli.cli", "engine", "--redis-url", "redis://127.0.0.1:1/0",
                          "--cpus", "0-"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--cpus: '0-' is not a CPU number" in out.stderr


@pytest.mark.parametrize(("flags", "says"), [
    (["--reserved-cpus", "-1"], "--reserved-cpus must be from 0 to"),
    (["--reserved-cpus", "4096"], "--reserved-cpus must be from 0 to"),
    (["--reserved-cpus", "1", "--cpus", "0"], "give --reserved-cpus or --cpus, not both"),
])
def test_sluice_serve_refuses_a_split_it_cannot_make(flags, says):
    out = subprocess.run([sys.executable, "-m", "sluice_cli.cli", "serve", "--redis-url", "redis://127.0.0.1:1/0",
                          *flags], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert says in out.stderr


def test_an_engine_in_a_narrower_cpuset_refuses_to_start_on_fewer_cpus(tmp_path):
    """A cgroup v1 cpuset of one CPU: Linux takes `--cpus 0-1` as the one and says nothing; the
    engine reads the CPUs back and exits 2 saying which it got."""
    cpus = _two_cpus()
    root = "/sys/fs/cgroup/cpuset"
    if not os.access(root, os.W_OK) or not os.path.exists(f"{root}/cpuset.cpus"):
        pytest.skip("no writable cgroup v1 cpuset hierarchy on this machine")
    group = f"{root}/sluice-test-{os.getpid()}"
    os.mkdir(group)
    try:
        for name, value in (("cpuset.cpus", str(cpus[0])), ("cpuset.mems", open(f"{root}/cpuset.mems").read())):
            with open(f"{group}/{name}", "w") as f:
                f.write(value)
        engine = [sys.executable, "-m", "sluice_cli.cli", "engine", "--redis-url", "redis://127.0.0.1:1/0",
                  "--cpus", format_cpu_list(cpus)]
        out = subprocess.run(["sh", "-c", f'echo $$ > {group}/tasks && exec "$@"', "sh", *engine],
                             capture_output=True, text=True, timeout=120)
    finally:
        os.rmdir(group)
    assert out.returncode == 2, out.stderr
    assert f"--cpus: the kernel gave CPUs {cpus[0]} of the {format_cpu_list(cpus)} asked for" in out.stderr


def test_an_engine_whose_placement_cannot_be_undone_still_raises_its_own_error(tmp_path, monkeypatch, caplog):
    """An engine that fails to start puts its threads back; where even that fails (a cpuset changed
    meanwhile), the failure is logged and the engine's own error is the one raised. Linux's side is
    stood in for: the first pin a no-op, the one back refused."""
    import torch

    from engine_service import LLM
    from sluice import cpu_placement

    calls = []

    def pin(cpus):
        calls.append(cpus)
        if len(calls) > 1:
            raise ValueError("the kernel refused them")

    monkeypatch.setattr(cpu_placement, "pin_process", pin)
    threads = torch.get_num_threads()
    try:
        with caplog.at_level("ERROR", logger="engine_service.engine"), \
                pytest.raises(FileNotFoundError, match="no-model"):
            LLM(str(tmp_path / "no-model"), cpus=str(min(allowed_cpus())))
        after = torch.get_num_threads()  # put back before the CPUs were tried
    finally:
        torch.set_num_threads(threads)
    assert calls == [[min(allowed_cpus())], cpu_placement.usable_cpus()]
    assert "could not put the process back on its CPUs" in caplog.text
    assert after == threads
