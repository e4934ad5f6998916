"""The notebooks in notebooks/: each one executed top to bottom (its asserts are the test),
stored without outputs, and with an install cell that does nothing where pyspark_txn is
importable."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from spark_connect import requires_spark_connect, wait_until_free

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
KERNEL = "pyspark-txn-tests"


def _ids(paths):
    return [p.stem for p in paths]


def _tracked_notebooks() -> list[Path]:
    """The notebooks git tracks (all of notebooks/ where git is unavailable)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", "notebooks/*.ipynb"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return NOTEBOOKS
    tracked = [ROOT / p for p in out.split("\0") if p]
    return sorted(set(tracked) | set(NOTEBOOKS))


def _install_cell(nb) -> str:
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "a notebook without code"
    return code[0].source


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {
        "01_quickstart.ipynb",
        "02_delta_to_delta.ipynb",
        "03_crash_and_recover.ipynb",
        "04_named_snapshots.ipynb",
    }


@pytest.mark.parametrize("path", _tracked_notebooks(), ids=_ids(_tracked_notebooks()))
def test_outputs_are_stripped(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: cell {i} has outputs; strip them"
            assert cell.execution_count is None, f"{path.name}: cell {i} has an execution count"
        assert "attachments" not in cell or not cell.attachments, f"{path.name}: cell {i}"
    assert "widgets" not in nb.metadata, f"{path.name}: widget state in the metadata"


class FakeIPython:
    def __init__(self) -> None:
        self.magics: list[tuple[str, str]] = []

    def run_line_magic(self, name: str, line: str) -> None:
        self.magics.append((name, line))


def _run_install_cell(source, monkeypatch, *, missing=(), ipython=None, databricks=False):
    """Execute an install cell with pip stubbed out, as if the ``missing`` packages were
    not importable; returns the pip commands it ran."""
    import importlib.util

    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "check_call", lambda cmd, *a, **k: calls.append(list(cmd)))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name in missing else real(name, *a, **k),
    )
    if databricks:
        monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "17.3")
    else:
        monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    namespace: dict = {"__name__": "__notebook__"}
    if ipython is not None:
        namespace["get_ipython"] = lambda: ipython
    exec(compile(source, "<install cell>", "exec"), namespace)
    return calls


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_install_cell_is_guarded(path, monkeypatch):
    source = _install_cell(nbformat.read(path, as_version=4))
    assert 'find_spec("pyspark_txn")' in source, "the first code cell must be the install cell"
    assert not any(line.lstrip().startswith(("%", "!")) for line in source.splitlines()), (
        "a bare %pip/!pip line cannot be guarded: it would run unconditionally"
    )

    # pyspark_txn importable (this venv): nothing is installed, with or without IPython
    ipython = FakeIPython()
    assert _run_install_cell(source, monkeypatch, ipython=ipython) == []
    assert ipython.magics == []
    assert _run_install_cell(source, monkeypatch, databricks=True) == []

    # missing, and no PYSPARK_TXN said what to install: a clear error, nothing installed
    # (pyspark-txn is not on PyPI: a bare name would install whatever holds it there)
    with pytest.raises(ImportError, match="set PYSPARK_TXN"):
        _run_install_cell(source, monkeypatch, missing={"pyspark_txn"})

    wheel = "/Workspace/Shared/pyspark_txn-0.1.0-py3-none-any.whl"
    assert "PYSPARK_TXN = None\n" in source
    source = source.replace("PYSPARK_TXN = None\n", f"PYSPARK_TXN = {wheel!r}\n")
    # missing where Spark is installed (a cluster, Databricks): pyspark-txn alone, so the
    # runtime's PySpark is kept; outside IPython through this interpreter's pip
    calls = _run_install_cell(source, monkeypatch, missing={"pyspark_txn"})
    assert calls == [[sys.executable, "-m", "pip", "install", "--quiet", wheel]]
    ipython = FakeIPython()
    _run_install_cell(
        source, monkeypatch, missing={"pyspark_txn"}, ipython=ipython, databricks=True
    )
    assert ipython.magics == [("pip", f"install --quiet {wheel}")]

    # missing, PySpark too (a fresh Jupyter): %pip, so the notebook's own environment gets both
    ipython = FakeIPython()
    calls = _run_install_cell(
        source, monkeypatch, missing={"pyspark_txn", "pyspark"}, ipython=ipython
    )
    assert calls == []
    lines = [shlex.split(line) for name, line in ipython.magics if name == "pip"]
    assert lines[0] == ["install", "--quiet", wheel]
    assert any(arg.startswith("pyspark>=") for args in lines[1:] for arg in args), lines


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory):
    """A folder for JUPYTER_PATH with a kernelspec that runs this interpreter (the venv's),
    with Spark's environment; found before any user or system kernelspec of that name."""
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    env = {
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"),
        "MPLBACKEND": "Agg",
    }
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "pyspark-txn tests",
                "language": "python",
                "env": env,
            }
        )
    )
    return str(root)


def _execute(path: Path, jupyter_path, tmp_path, monkeypatch, *, predefined_spark: str = ""):
    """Run every cell of the notebook at ``path`` in a fresh kernel; fail on the first error.
    ``predefined_spark``: code run first, defining ``spark`` as Databricks does."""
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    monkeypatch.setenv("JUPYTER_PATH", jupyter_path)
    # tempfile.mkdtemp() in the notebook (its WORK) lands in this test's folder
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    nb = nbformat.read(path, as_version=4)
    if predefined_spark:
        nb.cells.insert(0, nbformat.v4.new_code_cell(predefined_spark, id="predefined-spark"))
        nb.cells.append(
            nbformat.v4.new_code_cell(
                'assert spark is PREDEFINED_SPARK, "the notebook replaced the predefined spark"',
                id="same-spark",
            )
        )
    nb.cells.append(
        nbformat.v4.new_code_cell(
            f"import sys\nassert sys.executable == {sys.executable!r}, sys.executable",
            id="same-interpreter",
        )
    )
    # the client owns its kernel manager, so the kernel (and its Spark JVM) stops at the end
    client = NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    started = time.monotonic()
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{e}", pytrace=False)
    print(f"{path.name}: {time.monotonic() - started:.1f} s")
    return nb


def _printed(nb) -> str:
    return "".join(
        out.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.get("output_type") == "stream"
    )


@pytest.mark.spark
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs(path, jupyter_path, tmp_path, monkeypatch):
    """Top to bottom in Jupyter: no `spark` predefined, so pyspark_txn.local_session()."""
    nb = _execute(path, jupyter_path, tmp_path, monkeypatch)
    assert "registered:" in _printed(nb), f"{path.name}: the session cell printed nothing"


SPARK_CONNECT = """\
# As on Databricks serverless or standard (shared) compute: a predefined Spark Connect session
from pyspark.sql import SparkSession

spark = SparkSession.builder.remote("local[2]").config("spark.sql.shuffle.partitions", "2").getOrCreate()
PREDEFINED_SPARK = spark
"""


# Every notebook runs classic above; on Spark Connect the bounded set runs one (the crash
# and recover notebook: a failed query and its restart through Connect), SLOW=1 all.
CONNECT_BOUNDED = "03_crash_and_recover"


@pytest.mark.spark
@requires_spark_connect
@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, id=p.stem, marks=[] if p.stem == CONNECT_BOUNDED else [pytest.mark.slow])
        for p in NOTEBOOKS
    ],
)
def test_notebook_runs_on_predefined_spark_connect_session(
    path, jupyter_path, tmp_path, monkeypatch
):
    """With `spark` predefined (a local Spark Connect server): the notebook must use it, not
    start a session of its own, and everything must work through Spark Connect."""
    wait_until_free()
    nb = _execute(path, jupyter_path, tmp_path, monkeypatch, predefined_spark=SPARK_CONNECT)
    assert "registered:" in _printed(nb)
