"""The quickstart notebook runs headless from top to bottom without an error.

The notebook runs in its own kernel process (nbclient), so this test's 8-device XLA_FLAGS do not
reach it through JAX: the notebook's first cell sets XLA_FLAGS itself before importing JAX (the
test removes XLA_FLAGS from the kernel's environment to prove it). The kernel is a throw-away
kernelspec that runs ipykernel with this interpreter (sys.executable), found first through
JUPYTER_PATH, so the kernel sees the same virtual environment and the installed jaxsys whatever
`python3` kernels the user has registered elsewhere.
"""

import json
import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("rich")  # jax.debug.visualize_array_sharding draws with rich

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "quickstart.ipynb")


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    spec_dir = tmp_path / "jupyter" / "kernels" / "jaxsys-test"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "jaxsys test",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    workdir = tmp_path / "cwd"
    workdir.mkdir()

    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the notebook must set the device count itself
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="jaxsys-test", allow_errors=False, resources={"metadata": {"path": str(workdir)}}
    )  # the kernel's working directory
    client.execute(env=env)

    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not any(o.get("output_type") == "error" for o in cell.get("outputs", [])), cell.source
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "8 devices" in text  # the first cell's device count: XLA_FLAGS reached the kernel
    assert f"jax {__import__('jax').__version__}" in text
    assert "P('tensor', 'fsdp')" in text  # embed [V, D] at rest: vocab -> tensor, embed -> fsdp
    assert "jaxsys:" in text and "analysis: peak" in text  # train.main's start-up lines
    assert "memory per device        measured       formula (ZeRO)" in text  # format_report
    assert "collectives per step (measured)" in text
    assert "FLOPs per device per step: XLA" in text
    assert any(
        o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )
