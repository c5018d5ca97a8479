"""`flashgen check --emulate --target sm90a`: the sm90a family through its handlers under the
emulator, with the kernels that served each call in the table (the wgmma forward, or the sm80
family's kernels for the calls it does not take). The full standard sweep is recorded in
bench/results/ (BENCHMARKS.md, "Emulated correctness sweep"); CI runs two of its cases."""
import re

from conftest import needs_nvcc
from flashgen.emulate import check

pytestmark = needs_nvcc


def test_check_sm90a_reports_the_kernel_of_each_call(capsys, monkeypatch):
    # a dense call the wgmma forward serves (softcap and window included), and an ALiBi call it
    # leaves to the sm80 family (forward only: ~10 s of emulation)
    monkeypatch.setattr(check, "standard_cases", lambda c: [
        c.dense(seqlen_q=70, seqlen_k=90, window=(16, 0), softcap=3.0, backward=False),
        c.dense(seqlen_q=77, seqlen_k=129, heads_q=2, heads_kv=1, bottom_right=True, alibi="H", backward=False)])
    from flashgen.cli import main
    assert main(["check", "--target", "sm90a", "--emulate", "--hdim", "64", "--dtype", "bf16", "--causal",
                 "--seed", "3"]) == 0
    out = capsys.readouterr().out
    served = re.findall(r"^(dense|extras)\s+d64_bf16_causal_sm90a\s+.*?\s+o\s+.*?\s(\w+)\s+ok$", out, re.M)
    assert served == [("dense", "hopper_fwd_kernel"), ("extras", "flash_fwd_kernel")], out
