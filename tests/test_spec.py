import pytest

from flashgen import KernelSpec, target_name
from flashgen.spec import DTYPES, HEAD_DIMS


def test_valid_specs_and_stable_names():
    s = KernelSpec(64, "bfloat16", True, "sm90a")
    assert s.dtype == "bf16"
    assert s.target_name("fwd") == "flashgen_fwd_d64_bf16_causal"
    assert s.target_name("bwd") == "flashgen_bwd_d64_bf16_causal"
    assert KernelSpec(128, "f16").target_name("fwd") == "flashgen_fwd_d128_f16"
    # Names are the same for every target: one rewritten module runs on CPU and GPU.
    assert KernelSpec(32, "f32", False, "cpu").target_name("fwd") == KernelSpec(32, "f32", False, "sm80").target_name("fwd")
    names = {target_name(d, h, t, c) for d in ("fwd", "bwd") for h in HEAD_DIMS for t in DTYPES for c in (0, 1)}
    assert len(names) == 2 * len(HEAD_DIMS) * len(DTYPES) * 2


@pytest.mark.parametrize("kwargs, words", [
    (dict(head_dim=48), ["head_dim 48", "32, 64, 96"]),
    (dict(head_dim=64, dtype="f64"), ["dtype 'f64'", "bf16"]),
    (dict(head_dim=64, causal="yes"), ["causal"]),
    (dict(head_dim=64, target="sm70"), ["target 'sm70'", "sm90a"]),
    (dict(head_dim=64.0), ["head_dim must be an int"]),
])
def test_invalid_specs_say_which_field(kwargs, words):
    with pytest.raises(ValueError) as e:
        KernelSpec(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_stem_is_file_name_safe():
    for h in HEAD_DIMS:
        for t in DTYPES:
            stem = KernelSpec(h, t, True, "sm80").stem
            assert stem.replace("_", "").isalnum()
