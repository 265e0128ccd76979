"""CPU lists and pinning (sluice.cpu_placement), and the engine's --cpus: the list read and
refused, and an engine whose every thread runs on the CPUs it was given."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from sluice.cpu_placement import allowed_cpus, check_cpus, format_cpu_list, parse_cpu_list


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
    ("0-70000", "not a range"),
])
def test_a_list_that_names_no_cpus_is_refused_saying_why(text, says):
    with pytest.raises(ValueError, match="^--cpus: ") as err:
        check_cpus(text, "--cpus")
    assert says in str(err.value)


def test_cpus_this_process_may_not_use_are_refused():
    beyond = max(allowed_cpus()) + 1
    with pytest.raises(ValueError, match=f"--cpus: CPU {beyond} is not this process's to use"):
        check_cpus(f"0,{beyond}", "--cpus")
    assert check_cpus(format_cpu_list(allowed_cpus()), "--cpus") == allowed_cpus()


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


def test_an_engine_given_cpus_runs_every_thread_there_with_a_compute_thread_each(model_dir):
    cpus = _two_cpus()
    got = _run(f"""
        import os, torch
        from pathlib import Path
        from engine_service import LLM, SamplingParams

        llm = LLM({str(model_dir)!r}, cpus="{cpus[-1]}", kv_cache_memory=64 << 20)
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
        tasks = list(Path(f"/proc/{{os.getpid()}}/task").iterdir())
        print(len(out[0].outputs[0].token_ids), torch.get_num_threads(), len(tasks),
              sorted({{tuple(sorted(os.sched_getaffinity(int(t.name)))) for t in tasks}}))
        """)
    tokens, threads, tasks, masks = got.split(" ", 3)
    assert (tokens, threads) == ("4", "1")
    assert int(tasks) > 1  # torch's threads and the rest started, and all of them on the one CPU
    assert masks.strip() == str([(cpus[-1],)])


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
