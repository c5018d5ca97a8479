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
