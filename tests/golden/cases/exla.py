"""Modules hand-written the way EXLA (Elixir Nx) emits them: a public @main, sub-computations
outlined into private functions reached by func.call, reducers as regions, and the native
api_version = 4 custom-call form. The second module also carries an unrelated native custom
call that the rewrite must leave exactly as it is.
"""

import math

from .common import tname
from .registry import golden


EXLA_ATTENTION = """\
module @EXLA.attention {
  func.func public @main(%arg0: tensor<2x4x8x32xf32>, %arg1: tensor<2x4x8x32xf32>, %arg2: tensor<2x4x8x32xf32>, %arg3: tensor<2x4x8x32xf32>) -> (tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>) {
    %0 = func.call @attention_11(%arg0, %arg1, %arg2) : (tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>) -> tensor<2x4x8x32xf32>
    %1 = func.call @attention_11(%arg3, %arg1, %arg2) : (tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>) -> tensor<2x4x8x32xf32>
    return %0, %1 : tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>
  }
  func.func private @causal_mask_7() -> tensor<8x8xi1> {
    %0 = stablehlo.iota dim = 0 : tensor<8x8xi64>
    %1 = stablehlo.iota dim = 1 : tensor<8x8xi64>
    %2 = stablehlo.compare  GE, %0, %1,  SIGNED : (tensor<8x8xi64>, tensor<8x8xi64>) -> tensor<8x8xi1>
    return %2 : tensor<8x8xi1>
  }
  func.func private @softmax_9(%arg0: tensor<2x4x8x8xf32>) -> tensor<2x4x8x8xf32> {
    %cst = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %0 = stablehlo.reduce(%arg0 init: %cst) across dimensions = [3] : (tensor<2x4x8x8xf32>, tensor<f32>) -> tensor<2x4x8xf32>
     reducer(%a: tensor<f32>, %b: tensor<f32>)  {
      %m = stablehlo.maximum %a, %b : tensor<f32>
      stablehlo.return %m : tensor<f32>
    }
    %1 = stablehlo.reshape %0 : (tensor<2x4x8xf32>) -> tensor<2x4x8x1xf32>
    %2 = stablehlo.broadcast_in_dim %1, dims = [0, 1, 2, 3] : (tensor<2x4x8x1xf32>) -> tensor<2x4x8x8xf32>
    %3 = stablehlo.subtract %arg0, %2 : tensor<2x4x8x8xf32>
    %4 = stablehlo.exponential %3 : tensor<2x4x8x8xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %5 = stablehlo.reduce(%4 init: %cst_0) across dimensions = [3] : (tensor<2x4x8x8xf32>, tensor<f32>) -> tensor<2x4x8xf32>
     reducer(%a: tensor<f32>, %b: tensor<f32>)  {
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }
    %6 = stablehlo.reshape %5 : (tensor<2x4x8xf32>) -> tensor<2x4x8x1xf32>
    %7 = stablehlo.broadcast_in_dim %6, dims = [0, 1, 2, 3] : (tensor<2x4x8x1xf32>) -> tensor<2x4x8x8xf32>
    %8 = stablehlo.divide %4, %7 : tensor<2x4x8x8xf32>
    return %8 : tensor<2x4x8x8xf32>
  }
  func.func private @attention_11(%arg0: tensor<2x4x8x32xf32>, %arg1: tensor<2x4x8x32xf32>, %arg2: tensor<2x4x8x32xf32>) -> tensor<2x4x8x32xf32> {
    %0 = stablehlo.dot_general %arg0, %arg1, batching_dims = [0, 1] x [0, 1], contracting_dims = [3] x [3], precision = [DEFAULT, DEFAULT] : (tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>) -> tensor<2x4x8x8xf32>
    %cst = stablehlo.constant dense<3.200000e+01> : tensor<f32>
    %1 = stablehlo.sqrt %cst : tensor<f32>
    %2 = stablehlo.broadcast_in_dim %1, dims = [] : (tensor<f32>) -> tensor<2x4x8x8xf32>
    %3 = stablehlo.divide %0, %2 : tensor<2x4x8x8xf32>
    %4 = func.call @causal_mask_7() : () -> tensor<8x8xi1>
    %5 = stablehlo.broadcast_in_dim %4, dims = [2, 3] : (tensor<8x8xi1>) -> tensor<2x4x8x8xi1>
    %cst_0 = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %6 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<2x4x8x8xf32>
    %7 = stablehlo.select %5, %3, %6 : tensor<2x4x8x8xi1>, tensor<2x4x8x8xf32>
    %8 = func.call @softmax_9(%7) : (tensor<2x4x8x8xf32>) -> tensor<2x4x8x8xf32>
    %9 = stablehlo.dot_general %8, %arg2, batching_dims = [0, 1] x [0, 1], contracting_dims = [3] x [2], precision = [DEFAULT, DEFAULT] : (tensor<2x4x8x8xf32>, tensor<2x4x8x32xf32>) -> tensor<2x4x8x32xf32>
    return %9 : tensor<2x4x8x32xf32>
  }
}
"""


EXLA_NATIVE_CALL = """\
module @EXLA.native {
  func.func public @main(%arg0: tensor<1x8x2x64xbf16>, %arg1: tensor<1x8x2x64xbf16>, %arg2: tensor<1x8x2x64xbf16>, %arg3: tensor<4x4xf32>) -> (tensor<1x8x2x64xbf16>, tensor<4x4xf32>) {
    %0 = stablehlo.custom_call @exla_native_qr(%arg3) {api_version = 4 : i32, backend_config = {full_matrices = false, rank = 2 : i64}} : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %1 = stablehlo.convert %arg0 : (tensor<1x8x2x64xbf16>) -> tensor<1x8x2x64xf32>
    %2 = stablehlo.convert %arg1 : (tensor<1x8x2x64xbf16>) -> tensor<1x8x2x64xf32>
    %3 = stablehlo.convert %arg2 : (tensor<1x8x2x64xbf16>) -> tensor<1x8x2x64xf32>
    %4 = stablehlo.dot_general %1, %2, batching_dims = [0, 2] x [0, 2], contracting_dims = [3] x [3] : (tensor<1x8x2x64xf32>, tensor<1x8x2x64xf32>) -> tensor<1x2x8x8xf32>
    %cst = stablehlo.constant dense<1.250000e-01> : tensor<f32>
    %5 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<1x2x8x8xf32>
    %6 = stablehlo.multiply %4, %5 : tensor<1x2x8x8xf32>
    %7 = func.call @softmax_3(%6) : (tensor<1x2x8x8xf32>) -> tensor<1x2x8x8xf32>
    %8 = stablehlo.dot_general %3, %7, batching_dims = [0, 2] x [0, 1], contracting_dims = [1] x [3] : (tensor<1x8x2x64xf32>, tensor<1x2x8x8xf32>) -> tensor<1x2x64x8xf32>
    %9 = stablehlo.transpose %8, dims = [0, 3, 1, 2] : (tensor<1x2x64x8xf32>) -> tensor<1x8x2x64xf32>
    %10 = stablehlo.convert %9 : (tensor<1x8x2x64xf32>) -> tensor<1x8x2x64xbf16>
    return %10, %0 : tensor<1x8x2x64xbf16>, tensor<4x4xf32>
  }
  func.func private @softmax_3(%arg0: tensor<1x2x8x8xf32>) -> tensor<1x2x8x8xf32> {
    %cst = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %0 = stablehlo.reduce(%arg0 init: %cst) applies stablehlo.maximum across dimensions = [3] : (tensor<1x2x8x8xf32>, tensor<f32>) -> tensor<1x2x8xf32>
    %1 = stablehlo.broadcast_in_dim %0, dims = [0, 1, 2] : (tensor<1x2x8xf32>) -> tensor<1x2x8x8xf32>
    %2 = stablehlo.subtract %arg0, %1 : tensor<1x2x8x8xf32>
    %3 = stablehlo.exponential %2 : tensor<1x2x8x8xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %4 = stablehlo.reduce(%3 init: %cst_0) applies stablehlo.add across dimensions = [3] : (tensor<1x2x8x8xf32>, tensor<f32>) -> tensor<1x2x8xf32>
    %cst_1 = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %5 = stablehlo.broadcast_in_dim %cst_1, dims = [] : (tensor<f32>) -> tensor<1x2x8xf32>
    %6 = stablehlo.divide %5, %4 : tensor<1x2x8xf32>
    %7 = stablehlo.broadcast_in_dim %6, dims = [0, 1, 2] : (tensor<1x2x8xf32>) -> tensor<1x2x8x8xf32>
    %8 = stablehlo.multiply %3, %7 : tensor<1x2x8x8xf32>
    return %8 : tensor<1x2x8x8xf32>
  }
}
"""


class _Text:
    """A hand-written module, written out as it is."""

    def __init__(self, text):
        self.text = text

    def mlir_module(self):
        return self.text


@golden(rewritten=1, targets=[tname(32, "f32", True)], causal=True, scale=1 / math.sqrt(32))
def exla_attention():
    return _Text(EXLA_ATTENTION)


@golden(rewritten=1, targets=[tname(64, "bf16", False)], scale=0.125, numerics=False)
def exla_native_call():
    return _Text(EXLA_NATIVE_CALL)


EXLA_PADDING = """\
module @EXLA.padding {
  func.func public @main(%arg0: tensor<2x4x8x32xf32>, %arg1: tensor<2x4x8x32xf32>, %arg2: tensor<2x4x8x32xf32>, %arg3: tensor<2x8xi1>) -> tensor<2x4x8x32xf32> {
    %0 = func.call @attention_5(%arg0, %arg1, %arg2, %arg3) : (tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>, tensor<2x8xi1>) -> tensor<2x4x8x32xf32>
    return %0 : tensor<2x4x8x32xf32>
  }
  func.func private @attention_5(%arg0: tensor<2x4x8x32xf32>, %arg1: tensor<2x4x8x32xf32>, %arg2: tensor<2x4x8x32xf32>, %arg3: tensor<2x8xi1>) -> tensor<2x4x8x32xf32> {
    %0 = stablehlo.dot_general %arg0, %arg1, batching_dims = [0, 1] x [0, 1], contracting_dims = [3] x [3] : (tensor<2x4x8x32xf32>, tensor<2x4x8x32xf32>) -> tensor<2x4x8x8xf32>
    %cst = stablehlo.constant dense<1.250000e-01> : tensor<2x4x8x8xf32>
    %1 = stablehlo.multiply %0, %cst : tensor<2x4x8x8xf32>
    %2 = stablehlo.broadcast_in_dim %arg3, dims = [0, 3] : (tensor<2x8xi1>) -> tensor<2x4x8x8xi1>
    %cst_0 = stablehlo.constant dense<-1.000000e+09> : tensor<2x4x8x8xf32>
    %3 = stablehlo.select %2, %1, %cst_0 : tensor<2x4x8x8xi1>, tensor<2x4x8x8xf32>
    %cst_1 = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %4 = stablehlo.reduce(%3 init: %cst_1) applies stablehlo.maximum across dimensions = [3] : (tensor<2x4x8x8xf32>, tensor<f32>) -> tensor<2x4x8xf32>
    %5 = stablehlo.broadcast_in_dim %4, dims = [0, 1, 2] : (tensor<2x4x8xf32>) -> tensor<2x4x8x8xf32>
    %6 = stablehlo.subtract %3, %5 : tensor<2x4x8x8xf32>
    %7 = stablehlo.exponential %6 : tensor<2x4x8x8xf32>
    %cst_2 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %8 = stablehlo.reduce(%7 init: %cst_2) applies stablehlo.add across dimensions = [3] : (tensor<2x4x8x8xf32>, tensor<f32>) -> tensor<2x4x8xf32>
    %9 = stablehlo.broadcast_in_dim %8, dims = [0, 1, 2] : (tensor<2x4x8xf32>) -> tensor<2x4x8x8xf32>
    %10 = stablehlo.divide %7, %9 : tensor<2x4x8x8xf32>
    %11 = stablehlo.dot_general %10, %arg2, batching_dims = [0, 1] x [0, 1], contracting_dims = [3] x [2] : (tensor<2x4x8x8xf32>, tensor<2x4x8x32xf32>) -> tensor<2x4x8x32xf32>
    return %11 : tensor<2x4x8x32xf32>
  }
}
"""


@golden(rewritten=1, targets=[tname(32, "f32", False)], scale=0.125, extras=["segment_ids"])
def exla_padding_mask():
    # EXLA-style: the attention outlined into a private function that takes the padding mask
    return _Text(EXLA_PADDING)
