"""Session-wide fixtures: archives are built once, with the real torch-model-archiver.

Tiers: tests that use the real archives (`model_store`, `classifier`: about a minute to build)
are marked `slow` here, as are modules marked `slow` themselves; server tests are marked
`server`. `pytest -m "not slow and not server"` is the fast tier: pure code and tiny models.
"""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from filelock import FileLock

from handlers.image_classifier import ImageClassifierHandler
from tests.archives import TEST_REFERENCE_REQUESTS, load_classifier, load_classifier_dir, stage_model_dir
from torchserve_vision import paths
from torchserve_vision.archives.build import build_archive
from torchserve_vision.model_descriptions import load_descriptions, parse_description

HEAVY_FIXTURES = {"model_store", "classifier"}
SHORT_BASETEMP = pytest.StashKey[Path]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu", action="store_true",
                     help="run the tests marked gpu (a CUDA device is needed; without --gpu they "
                          "are deselected, as on the CPU machines CI runs on)")
    parser.addoption("--gpu-device", default="cuda:0",
                     help="the device the gpu tests hold to the CPU's answers (default cuda:0; "
                          "'cpu' rehearses them on a CPU machine)")


# The modules that take longest (measured with --durations on the 2-core AVX2 EPYC, longest
# first): run in several processes, each module stays in one process (--dist loadfile), so these
# start first and the short ones fill in around them.
LONGEST_MODULES = (
    "tests/server/test_autoscaling_metrics.py", "tests/server/rollouts/test_rollouts.py",
    "tests/unit/test_object_detector.py", "tests/server/rollouts/test_killed_rollbacks.py",
    "tests/server/rollouts/test_killed_rollouts.py", "tests/server/test_rolling_update.py",
    "tests/server/test_canary.py", "tests/server/test_serving_lab_smoke.py",
    "tests/server/test_faults.py", "tests/server/test_pod_lifecycle.py",
    "tests/server/test_queued_batching.py",
)


def running_order(item: pytest.Item) -> tuple[int, int]:
    """The longest modules first, then the other server modules, the other slow ones, the rest
    (a stable sort: tests keep their order within a module)."""
    module = item.nodeid.split("::")[0]
    if module in LONGEST_MODULES:
        return 0, LONGEST_MODULES.index(module)
    return (1 if item.get_closest_marker("server") else 2 if item.get_closest_marker("slow") else 3), 0


def pytest_configure(config: pytest.Config) -> None:
    """Run in several processes (pytest-xdist), each process's temporary directories are a level
    deeper than pytest's own (pytest-of-USER/pytest-N/popen-gwK): the Unix sockets HAProxy binds
    in a run directory there passed its 97-character limit. The run's temporary directories go
    under a short fresh /tmp/tsv-tests-* instead, removed when the run passes."""
    if (config.option.basetemp is None and not hasattr(config, "workerinput")
            and getattr(config.option, "numprocesses", None)):
        config.option.basetemp = tempfile.mkdtemp(prefix="tsv-tests-")
        config.stash[SHORT_BASETEMP] = Path(config.option.basetemp)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    base = session.config.stash.get(SHORT_BASETEMP, None)
    if base is not None and exitstatus == 0:
        shutil.rmtree(base, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of the real archives slow; deselect the gpu tests unless --gpu is given
    (deselected, not skipped: a GPU run asked with --gpu fails where no GPU answers); put the
    longest modules first (running_order)."""
    for item in items:
        if HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=running_order)
    if config.getoption("--gpu"):
        return
    deselected = [item for item in items if item.get_closest_marker("gpu")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


def build_described(name: str, store: Path) -> Path:
    """Build the archive config/models.yaml describes under `name` (in a process of its own)."""
    description = next(d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.name == name)
    return build_archive(description, store, reference_requests=TEST_REFERENCE_REQUESTS)


def build_model_store(store: Path) -> None:
    """Every model of config/models.yaml as described, built into `store`. Two processes build
    the single-model archives side by side (measured on 2 cores: 172 s against 201 s one after
    another: export and lowering are single-threaded), then the pipelines, which copy their
    stages, are built."""
    descriptions = load_descriptions(paths.MODEL_DESCRIPTIONS)
    singles = [d.name for d in descriptions if not d.is_pipeline]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(build_described, singles, [store] * len(singles)))
    for description in descriptions:
        if description.is_pipeline:
            build_archive(description, store)


def built_once(run_root: Path) -> Path:
    """The model store built once for every test process of a run (pytest-xdist's workers share
    `run_root`): the first process to take the lock builds it, the others wait and reuse it. A
    failed build leaves no mark, so each process tries (and reports) it again."""
    built, done = run_root / "model_store_built", run_root / "model_store_built.done"
    with FileLock(run_root / "model_store_built.lock"):
        if not done.exists():
            shutil.rmtree(built, ignore_errors=True)
            built.mkdir()
            build_model_store(built)
            done.touch()
    return built


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """Every model of config/models.yaml as described, in a fresh model store of this test
    process's own: the classifiers with their ahead-of-time compiled models (about a minute
    each; their workers then start in seconds), so that every runner is checked on the CPU the
    tests run on. Run in several processes, the archives are built once and each process gets
    its own copy (tests add archives to their store and register what it holds)."""
    store = tmp_path_factory.mktemp("model_store")
    if worker_id == "master":
        build_model_store(store)
        return store
    shutil.copytree(built_once(tmp_path_factory.getbasetemp().parent), store, dirs_exist_ok=True)
    return store


@pytest.fixture(scope="session")
def classifier(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> ImageClassifierHandler:
    """The default classifier archive, loaded in-process (real weights, CPU, compiled package)."""
    return load_classifier(model_store / "efficientnet_lite0-1.0.mar",
                           tmp_path_factory.mktemp("extracted"))


@pytest.fixture(scope="session")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory) -> ImageClassifierHandler:
    """A classifier handler on timm's tiny `test_efficientnet` (fixed seed 1: the five bundled
    photos get five different answers), 64 px input, eager: for handler mechanics that need no
    real weights. Staged in about a second."""
    description = parse_description({
        "name": "tiny", "version": "1.0", "labels": "imagenet",
        "model": {"source": "timm", "architecture": "test_efficientnet", "weights": "fixed-seed:1"},
        "handler": {"preprocess": {"resize_size": 72, "input_size": 64}}})
    return load_classifier_dir(stage_model_dir(description, tmp_path_factory.mktemp("tiny")))
