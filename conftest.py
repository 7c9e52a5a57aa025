"""Test configuration shared by every test tree (packages/*/tests, services/*/tests, tests/).

Each member's tests also run alone, in an environment holding only that member, its declared
dependencies and its `dev` group (scripts/check_members.py). So this module imports only the
standard library and pytest at its top level: torch is imported only where it is installed, and
the fixtures below import the rlt packages they need inside their bodies (a member whose tests
use one declares what it imports).

- Hugging Face libraries run offline; engines use no start-up cache ($RLT_CACHE_DIR=off).
- Tests marked `cuda` are skipped, with the reason, where no CUDA device is present; Triton
  kernels then run in Triton's interpreter.
- `tiny_checkpoint` writes small random Ouro checkpoints once per session and shape.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines built by tests (and the servers they start) neither read nor write the kernel-choice
# cache: tests that force a choice must see it measured
# (services/rlt-engine/tests/test_kernel_choice_cache.py passes its own directory).
os.environ["RLT_CACHE_DIR"] = "off"


def usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_count() -> int:
    """Worker processes of a plain `pytest` run: $RLT_TEST_WORKERS, else the CPUs this process
    may use (at most 4); fewer than 2 means no workers."""
    if "RLT_TEST_WORKERS" in os.environ:
        return int(os.environ["RLT_TEST_WORKERS"])
    return min(usable_cpus(), 4)


LOADGROUP_ENV = "RLT_PYTEST_LOADGROUP"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Spread a run over worker processes (pytest-xdist, `--dist loadgroup`) where xdist is
    installed (the workspace's `dev` group; members' own environments run serially) and the
    command line does not choose: `-n 0` or `-p no:xdist` run in one process, `-n N` picks N.
    Not set in addopts because pytest refuses `-n` where the plugin is missing. Runs before
    xdist's own pytest_cmdline_main (conftest hooks are registered after the plugin's)."""
    option = config.option
    if hasattr(config, "workerinput") and os.environ.get(LOADGROUP_ENV) == "1":
        # A worker builds its options from the command line, which never said --dist
        # loadgroup (set below): without this the `xdist_group` marks group nothing there.
        option.loadgroup = True
    if (
        not config.pluginmanager.hasplugin("xdist")
        or hasattr(config, "workerinput")  # an xdist worker itself
        or getattr(option, "numprocesses", None) is not None
        or getattr(option, "dist", "no") != "no"
        or option.usepdb
        or option.collectonly
    ):
        return
    workers = worker_count()
    if workers >= 2:
        option.numprocesses = workers
        option.dist = "loadgroup"
        if getattr(option, "maxworkerrestart", None) is None:
            # a crashed worker ends the run with its test named: replaced workers under
            # loadgroup once left the run waiting forever at 98% (2026-12-02)
            option.maxworkerrestart = "0"
        os.environ[LOADGROUP_ENV] = "1"  # read by the workers (above); they inherit it
        # The CPUs shared out: torch's intra-op pool in each worker (and in the servers its
        # tests start, which inherit the environment) is sized to its share, not to all of them.
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // workers)))


def _suffix_xdist_groups(items) -> None:
    """`--dist loadgroup` sends the tests whose node ids end in "@GROUP" to one worker; xdist
    3.8 appends that suffix by assigning `item._nodeid`, which pytest 9 no longer reads (node
    ids live in `item._id`), so the `xdist_group` marks would group nothing (seen: the Ray
    tests started one cluster per worker). Same suffix, on the attribute pytest reads."""
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest < 9 (the GPU machine's 8.x) reads item._nodeid: xdist's works
        return
    for item in items:
        names = sorted(
            {
                str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                for m in item.iter_markers("xdist_group")
            }
        )
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix):
            old = item._id
            last = old.names[-1] + (f"[{old.params}]" if old.params is not None else "")
            item._id = NodeId(path=old.path, names=(*old.names[:-1], last + suffix))


def cuda_available() -> bool:
    """Whether torch is installed and sees a CUDA device (False in torch-free environments)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


if importlib.util.find_spec("torch") is not None and not cuda_available():
    # Triton kernels are defined at import: without CUDA, define them for the interpreter so
    # CPU tests can run them (slowly) against their torch references.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(trylast=True)  # after xdist's own hook, which adds the same suffix
def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput") and config.getvalue("loadgroup"):
        _suffix_xdist_groups(items)
    if hasattr(config, "workerinput"):
        # On xdist workers (every worker sorts alike): the `slow` tests first, so that they are
        # dealt out across the workers at the start rather than left to one worker at the end.
        items.sort(key=lambda item: "slow" not in item.keywords)
    cuda_items = [item for item in items if "cuda" in item.keywords]
    if not cuda_items or cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available on this machine")
    for item in cuda_items:
        item.add_marker(skip)


TINY_SHAPES = {
    # name: (layers, loops, hidden, heads, kv_heads, head_dim, intermediate, vocab)
    "l2_t4": (2, 4, 64, 4, 2, 16, 128, 320),
    "l3_t2": (3, 2, 48, 3, 3, 16, 96, 300),
    "l1_t3_mha": (1, 3, 32, 2, 2, 16, 64, 272),
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: tiny_checkpoint(name="l2_t4", seed=0, dtype="float32", **init) -> Path."""
    from rlt_models import OuroConfig, RandomInit, write_random_checkpoint

    cache = {}

    def make(name: str = "l2_t4", *, seed: int = 0, dtype: str = "float32", **init_kwargs):
        key = (name, seed, dtype, tuple(sorted(init_kwargs.items())))
        if key not in cache:
            layers, loops, hidden, heads, kv_heads, head_dim, inter, vocab = TINY_SHAPES[name]
            config = OuroConfig(
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=inter,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                total_ut_steps=loops,
                max_position_embeddings=512,
            )
            out = tmp_path_factory.mktemp(f"ckpt_{name}_s{seed}")
            cache[key] = write_random_checkpoint(
                out, config, seed=seed, dtype=dtype, init=RandomInit(**init_kwargs)
            )
        return cache[key]

    return make


@pytest.fixture
def llm_factory(tiny_checkpoint):
    """Factory: llm_factory(shape="l2_t4", seed=3, gate_std=0.3, **engine_options) -> LLM.

    Defaults make tiny fp32 CPU engines that chunk prompts and queue requests. After the test,
    every engine built here must hold no KV block, and its runner may only keep the state of
    requests whose release is already queued for the next step (no leak)."""
    from rlt import LLM

    engines = []

    def make(shape: str = "l2_t4", *, seed: int = 3, gate_std: float = 0.3, **options):
        defaults = dict(
            dtype="float32",
            device="cpu",
            block_size=4,
            num_kv_blocks=512,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            prefill_chunk_size=5,
        )
        llm = LLM(tiny_checkpoint(shape, seed=seed, gate_std=gate_std), **{**defaults, **options})
        engines.append(llm)
        return llm

    yield make
    try:
        for llm in engines:
            assert_no_kv_leak(llm)
    finally:
        for llm in engines:  # a PD engine's NIXL agent polls a core until it is closed
            if llm.engine.core is not None and getattr(llm.engine.parts, "pd", None) is not None:
                llm.engine.shutdown()


def assert_no_kv_leak(llm) -> None:
    if llm.engine.core is None:
        return  # shut down: its device state is gone
    assert llm.engine.core.leak_report() == []
