// sharp::AddBlockOffsets (opset 1) for ONNX Runtime's CPU execution provider, per docs/op.md: Y = P + S · C, where
// S[r, b] is the sum of row r of X over its b-th block of K / blocks columns and C is (blocks, N).
//
// It is the other half of a blockwise-affine weight (llama.cpp's Q4_1: w = d·q + m in every block of 32): a
// MatMulNBits computes x · (d·q) and this op adds each block's minimum m times the block's sum of x. As standard ops
// (its fallback body) that is Reshape, ReduceSum, MatMul and Add — four nodes, each mostly its runtime's per-node
// cost at decode, where a row is a few hundred floats. Here it is one node and one pass: the block sums of every row,
// then, a task per strip of output columns, P's strip plus the sums times C's strip (C in fp16 is widened a strip at
// a time). Included once, by sharp_attention.cc, which registers it beside SharpAttention.

constexpr int64_t kOffsetColumns = 256;  // output columns per task

[[noreturn]] void offsets_invalid(const std::string& message) {
  throw Error(ORT_INVALID_ARGUMENT, "AddBlockOffsets: " + message);
}

struct OffsetsProblem {
  const float* p;
  const float* c;  // C in fp32, or null when it is fp16
  const Half* c16;
  float* y;
  int64_t rows, blocks, n;
  const float* sums;  // (rows, blocks)
};

void offsets_task(void* data, size_t task) {
  const OffsetsProblem& q = *static_cast<const OffsetsProblem*>(data);
  using Strided = Eigen::Map<RowMajor, 0, Eigen::OuterStride<>>;
  using ConstStrided = Eigen::Map<const RowMajor, 0, Eigen::OuterStride<>>;
  const int64_t j0 = static_cast<int64_t>(task) * kOffsetColumns, w = std::min(kOffsetColumns, q.n - j0);
  const float* c = q.c != nullptr ? q.c + j0 : nullptr;
  int64_t stride = q.n;
  thread_local AlignedFloats strip;
  if (c == nullptr) {
    strip.resize(static_cast<size_t>(q.blocks * w));
    for (int64_t b = 0; b < q.blocks; ++b) widen(q.c16 + b * q.n + j0, strip.data() + b * w, w);
    c = strip.data(), stride = w;
  }
  ConstStrided cm(c, q.blocks, w, Eigen::OuterStride<>(stride));
  ConstMatrix s(q.sums, q.rows, q.blocks);
  Strided y(q.y + j0, q.rows, w, Eigen::OuterStride<>(q.n));
  y = ConstStrided(q.p + j0, q.rows, w, Eigen::OuterStride<>(q.n));
  y.noalias() += s * cm;
}

struct OffsetsKernel {
  explicit OffsetsKernel(const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* ctx) const {
    const OrtApi& api = Ort::GetApi();
    size_t count = 0;
    check(api.KernelContext_GetInputCount(ctx, &count));
    const Tensor p = input(ctx, count, 0), x = input(ctx, count, 1), c = input(ctx, count, 2);
    if (!p.present() || !x.present() || !c.present()) offsets_invalid("needs inputs P, X and C");
    if (p.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || x.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
      offsets_invalid("P and X must be float32");
    const bool half = c.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    if (!half && c.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) offsets_invalid("C must be float32 or float16");
    if (c.shape.size() != 2 || x.shape.empty() || p.shape.size() != x.shape.size())
      offsets_invalid("expected C (blocks, N), X (..., K) and P (..., N) of X's rank; got C " +
                      shape_string(c.shape) + ", X " + shape_string(x.shape) + ", P " + shape_string(p.shape));
    const int64_t blocks = c.shape[0], n = c.shape[1], k = x.shape.back();
    if (blocks <= 0 || k % blocks != 0)
      offsets_invalid("X's last dimension " + std::to_string(k) + " is not a multiple of C's " +
                      std::to_string(blocks) + " blocks");
    if (p.shape.back() != n || !std::equal(p.shape.begin(), p.shape.end() - 1, x.shape.begin()))
      offsets_invalid("P has shape " + shape_string(p.shape) + "; expected X's leading dimensions and N = " +
                      std::to_string(n));
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < x.shape.size(); ++i) rows *= x.shape[i];

    OrtValue* out = nullptr;
    check(api.KernelContext_GetOutput(ctx, 0, p.shape.data(), p.shape.size(), &out));
    float* y = nullptr;
    check(api.GetTensorMutableData(out, reinterpret_cast<void**>(&y)));
    if (rows == 0 || n == 0) return;
    AlignedFloats sums(static_cast<size_t>(rows * blocks));
    Matrix(sums.data(), rows * blocks, 1) = ConstMatrix(x.f(), rows * blocks, k / blocks).rowwise().sum();
    OffsetsProblem q{p.f(), half ? nullptr : c.f(), half ? static_cast<const Half*>(c.data) : nullptr, y,
                     rows, blocks, n, sums.data()};
    const size_t tasks = static_cast<size_t>((n + kOffsetColumns - 1) / kOffsetColumns);
    if (tasks == 1) {
      offsets_task(&q, 0);
    } else {
      check(api.KernelContext_ParallelFor(ctx, offsets_task, tasks, 0, &q));
    }
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) const {
    return as_status("AddBlockOffsets", [&] { Compute(ctx); });
  }
};

struct OffsetsOp : Ort::CustomOpBase<OffsetsOp, OffsetsKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return as_status("AddBlockOffsets", [&] { *kernel = new OffsetsKernel(info); });
  }
  const char* GetName() const { return "AddBlockOffsets"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t i) const {  // C: float or float16
    return i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};
