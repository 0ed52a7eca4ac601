"""Results in a notebook (issue 56, item 7): a real notebook, executed by a Jupyter kernel
(nbclient), shows a digit map, its coverage, a diff, a precision plan, its check and an impact
as HTML (their ``_repr_html_``: the pages' tables and findings) and prints each as a readable
``repr``, never ``<... object at 0x...>``."""

from __future__ import annotations

import re
import textwrap

import pytest

nbformat = pytest.importorskip("nbformat", reason="the test extra installs nbformat")
nbclient = pytest.importorskip("nbclient", reason="the test extra installs nbclient")
pytest.importorskip("ipykernel", reason="the test extra installs ipykernel")

_CELLS = [
    """
    import warnings
    warnings.simplefilter("ignore")
    import torch
    from torch import nn
    import fxstab

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 8)

        def forward(self, x):
            z = self.fc(x + 100.0)
            v = (z * z).mean(-1, keepdim=True) - z.mean(-1, keepdim=True) ** 2
            return torch.softmax(z / torch.sqrt(v.abs() + 1e-5), -1)

    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    be = fxstab.backend(format="fp16")
    torch.compile(model, backend=be)(x)
    dm = be.digit_map()
    dm
    """,
    "be.coverage()",
    "fxstab.diff(dm, dm)",
    """
    plan = fxstab.plan_precision(model, (x,), format="fp16", keep=1.0, budget=40)
    plan
    """,
    """
    check = fxstab.check_plan(model, (x,), plan)
    print(check)
    check
    """,
    "fxstab.operator_impact(model, (x,), format='fp16')",
]


def _outputs(cell) -> tuple:
    """(text/html, text/plain, stdout) of an executed cell."""
    html = plain = stdout = ""
    for out in cell.outputs:
        if out.output_type == "stream" and out.name == "stdout":
            stdout += out.text
        elif out.output_type in ("execute_result", "display_data"):
            html += out.data.get("text/html", "")
            plain += out.data.get("text/plain", "")
    return html, plain, stdout


@pytest.mark.slow
def test_results_display_themselves_in_a_notebook(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(textwrap.dedent(c).strip()) for c in _CELLS]
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError with the cell's traceback if one fails
    nbformat.write(nb, tmp_path / "results.ipynb")  # what a user would open
    shown = [_outputs(c) for c in nb.cells]
    for html, plain, stdout in shown:
        assert not re.search(r"object at 0x", plain + stdout), (plain, stdout)
        assert html.startswith('<div class="fxstab-nb"><style>') and "<script" not in html

    html, plain, _ = shown[0]  # the map: findings, the worst operators, the coverage
    assert plain.startswith("DigitMap(") and "format='fp16'" in plain
    assert "<h4>Findings</h4>" in html and "fc/linear#0" in html
    assert re.search(r"<th>avg digits</th>", html) and "Coverage" in html
    html, plain, _ = shown[1]  # the coverage
    assert plain.startswith("Coverage(") and "floating operators analysed" in plain
    assert "floating operators were analysed" in html
    html, plain, _ = shown[2]  # the diff of a map with itself: the gate passes
    assert plain.startswith("DiffResult(OK: no operator lost")
    assert 'class="verdict pass"' in html
    html, plain, _ = shown[3]  # the plan
    assert plain.startswith("PrecisionPlan(") and "operators in fp32" in plain
    assert "Promoted operators" in html and "digits without the plan" in html
    html, plain, stdout = shown[4]  # the check: print() and the display
    assert stdout.startswith("PlanCheck(avg true digits at the outputs:"), stdout
    assert "without the plan" in html and "all in the higher format" in html
    html, plain, _ = shown[5]  # the impact
    assert plain.startswith("Impact(") and "analysed calls" in plain
    assert "impact (digits)" in html and "group bound" in html
