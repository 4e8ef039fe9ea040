// Host helpers shared by chapter 14's Hopper kernels (flash_attention_hopper.cu,
// flash_attention_hopper_bwd.cu and flash_attention_hopper_fp8.cu); course_utils.toolbox.cuda.
// load_cuda puts this file in place of the #include.

static void check_cuda(cudaError_t err, const char* what) {
    TORCH_CHECK(err == cudaSuccess, what, ": ", cudaGetErrorString(err));
}

// A 3D TMA map over a (B*H, N, D) tensor, bf16 or (the FP8 kernel's e4m3 bytes) uint8: boxes of
// `rows` rows x 128 bytes of one head (64 bf16 or 128 e4m3), 128-byte swizzle, zeros past row N.
static CUtensorMap make_map(const torch::Tensor& X, int rows) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (!encode) {
        cudaDriverEntryPointQueryResult found;
        check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled",
                                                    reinterpret_cast<void**>(&encode), 12000,
                                                    cudaEnableDefault, &found),
                   "make_map: looking up cuTensorMapEncodeTiled");
        TORCH_CHECK(found == cudaDriverEntryPointSuccess && encode,
                    "make_map: the driver has no cuTensorMapEncodeTiled (CUDA 12+ needed)");
    }
    TORCH_CHECK(X.scalar_type() == torch::kBFloat16 || X.scalar_type() == torch::kByte,
                "make_map: a bfloat16 or uint8 tensor");
    const int64_t e = X.element_size();  // bytes an element: 2 or 1
    const int64_t D = X.size(3), N = X.size(2), BH = X.size(0) * X.size(1);
    CUtensorMap map;
    const cuuint64_t dims[3] = {(cuuint64_t)D, (cuuint64_t)N, (cuuint64_t)BH};
    const cuuint64_t strides[2] = {(cuuint64_t)(D * e), (cuuint64_t)(N * D * e)};
    const cuuint32_t box[3] = {(cuuint32_t)(128 / e), (cuuint32_t)rows, 1}, step[3] = {1, 1, 1};
    const CUresult r = encode(&map, e == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                              3, X.data_ptr(), dims, strides,
                              box, step, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    TORCH_CHECK(r == CUDA_SUCCESS, "make_map: cuTensorMapEncodeTiled failed (", (int)r, ")");
    return map;
}
