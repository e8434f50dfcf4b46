"""benchmarks/bias_ablations.py: every timing-only edit still applies to the kernels' source."""

import filecmp
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("bias_ablations", ROOT / "benchmarks" / "bias_ablations.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_ablation_edits_the_kernels_and_nothing_else(tmp_path):
    mod = _module()
    made = mod.build(tmp_path)
    assert set(made) == {"none", *mod.VARIANTS}
    none = made["none"] / "flexhstu"
    assert filecmp.cmp(none / "ops/triton/bias_tiles.py", ROOT / "flexhstu/ops/triton/bias_tiles.py", shallow=False)
    for name, edits in mod.VARIANTS.items():
        changed = {rel for rel, _ in edits}
        for rel in (mod.BIAS, mod.DKDV):
            same = filecmp.cmp(made[name] / "flexhstu" / rel, none / rel, shallow=False)
            assert same == (rel not in changed), (name, rel)
        for rel in changed:  # still Python (the edits cut whole statements)
            compile((made[name] / "flexhstu" / rel).read_text(), rel, "exec")
