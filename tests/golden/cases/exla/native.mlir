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
