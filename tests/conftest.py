"""Test-wide settings. TRITON_INTERPRET must be set before anything imports triton."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sys

import pytest

from tests import memory_hygiene, xdist_support


@pytest.fixture(autouse=True)
def kernel_settings():
    """The kernels read ``PAGODA_KERNELS`` / ``PAGODA_CPU_KERNELS`` once, not per call
    (``kernels.reload_settings``): every test starts, and leaves, with the settings of its
    environment; a test that changes one mid-test reloads them itself."""
    _reload_kernel_settings()
    yield
    _reload_kernel_settings()  # after monkeypatch has put the environment back (torn down first)


def _reload_kernel_settings() -> None:
    kernels = sys.modules.get("pagoda.kernels")  # not imported yet: it will read the environment then
    if kernels is not None:
        kernels.reload_settings()


@pytest.fixture
def restore_threads():
    """For a test that sets torch's intra-op threads (a bench's worker, ``--threads``): the
    rest of the session gets its own count back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_path():
    """The default model folder (SmolLM2-135M-Instruct), imported once from the GGUF."""
    from pagoda.models.gguf_import import ensure_default_model

    return str(ensure_default_model())


@pytest.fixture(scope="session")
def smollm2_lora(tmp_path_factory, smollm2_path):
    """A random PEFT LoRA adapter (q/v, rank 8) for the default model, made with ``peft``."""
    pytest.importorskip("peft")
    from tests.engine.lora_reference import make_peft_adapter

    return str(make_peft_adapter(smollm2_path, tmp_path_factory.mktemp("lora"), "attn-qv", seed=0))



def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    """An xdist worker shares the cores with the others (tests/xdist_support.py)."""
    if _is_xdist_worker(config):
        xdist_support.share_cores(config)


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected
def pytest_collection_modifyitems(config, items):
    """Start the sm_90 compile runs of the selected tests in the background (idle CPU: see
    tests/kernels/sm90_runs.py), in the order those tests run. An xdist worker starts none:
    it reads the runs the controller started (``pytest_xdist_node_collection_finished``)."""
    if config.option.collectonly:
        return
    if _is_xdist_worker(config):  # tests/xdist_support.py
        from tests.kernels.sm90_runs import runs

        xdist_support.write_groups(config, items)
        runs(shared_dir=config.workerinput.get(xdist_support.FOLDER_KEY))  # none: a test runs its family
        return
    selected = [item for item in items if item.module.__name__.endswith("test_compile_sm90")
                and item.name in item.module.FAMILIES]
    if selected and selected[0].module._sm90_api_missing() is None:
        from tests.kernels.sm90_runs import runs

        runs().start([item.module.FAMILIES[item.name] for item in selected])


def pytest_collection_finish(session):
    """Every test module imported: freeze what survives a full collection (tests/memory_hygiene.py)."""
    memory_hygiene.freeze_survivors()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Free what the test dropped (engines are reference cycles) once it has run: after its
    teardown pytest also drops the test's fixture values (``item.funcargs``), which the
    teardown hook still sees; freezing those would keep a module fixture's engine for good."""
    yield
    memory_hygiene.after_test(item, nextitem)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller: its folder (the workers' groups, the sm_90 runs' outputs), for every worker."""
    node.workerinput[xdist_support.FOLDER_KEY] = xdist_support.controller_folder(node.config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist controller: ``--dist loadgroup`` by the workers' groups (tests/xdist_support.py)."""
    return xdist_support.make_scheduler(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist controller: start the sm_90 runs of the selected tests once, when a worker has
    collected (every worker collects the same tests, ``-k``/``-m`` applied), in their order."""
    if node.config.option.collectonly:
        return
    import importlib

    module = importlib.import_module("tests.kernels.test_compile_sm90")
    names = [i.split("@")[0].split("::")[-1] for i in ids if i.split("::")[0].endswith("test_compile_sm90.py")]
    families = [module.FAMILIES[name] for name in names if name in module.FAMILIES]
    if families and module._sm90_api_missing() is None:
        from tests.kernels.sm90_runs import runs

        runs(results_dir=xdist_support.controller_folder(node.config)).start(families)


def pytest_sessionfinish(session, exitstatus):
    """End the background compile runs a session did not wait for (and their Triton cache)."""
    import shutil
    import sys

    module = sys.modules.get("tests.kernels.sm90_runs")
    if module is not None and module.RUNS is not None and not _is_xdist_worker(session.config):
        module.RUNS.stop()
    if hasattr(session.config, "_pagoda_xdist_dir"):  # the xdist controller's, even if nothing started
        shutil.rmtree(session.config._pagoda_xdist_dir, ignore_errors=True)
