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
