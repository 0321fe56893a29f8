// sharp::SharpAttention (opset 1) for ONNX Runtime's CPU execution provider, per docs/op.md.
//
// Work is split into tasks of (batch, KV head, query tile), the tile's rows of every query head sharing that KV
// head stacked (GQA: K and V are read once per group). A task computes its rows' logits against every key they can
// see with one GEMM (Eigen; a few rows — decode — with matrix-vector products a block of keys at a time),
// normalises each row in place (softmax family: max-relative softmax and entropy; entmax family: safeguarded
// Halley/Newton threshold, as in docs/attention.md; exp and log on Eigen's packets), then multiplies by V with
// GEMMs over the key blocks that carry weight. A decode step of the softmax family splits each row's keys into
// 512-key chunks instead (one task each, combined by rescaling to the row's max: "decode split over the keys").
// Extra memory is one (stacked rows × visible keys) buffer per thread:
// O(L · tile), never O(Lq · Lk). Tasks run on ORT's intra-op thread pool and write disjoint outputs, so results
// do not depend on the thread count.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

// Eigen's default alignment follows -march (32 bytes without AVX-512): fix it at 64 so aligned_allocator and the
// Aligned64 maps below agree on every CPU.
#define EIGEN_MAX_ALIGN_BYTES 64
#include <Eigen/Core>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace sharp {

enum class Family { kSoftmax, kEntmax };
enum class Transform { kIdentity, kLogNScale, kSignedLog, kEntropyBeta, kNone };

struct NormEntry {
  const char* name;
  Family family;
  Transform transform;
  bool query_scale;
  int num_params;
  const char* params[2];
};

#include "norm_table.h"

// The op's input slots (docs/op.md), in order; 10–12 make the cache form (a KV cache written in place), 13–14 add
// its key summary (per page of kPage keys the per-dimension minima and maxima: sparse entmax decode).
enum Slot {
  kQ, kK, kV, kKeyMask, kAlibi, kAlpha, kQueryScale, kSsaN, kSsaB, kSsmaxS, kPastKey, kPastValue, kPastLength,
  kPastKeySummary, kSummaryLength, kNumSlots
};
constexpr const char* kSlotNames[kNumSlots] = {"Q",     "K",           "V",     "key_mask", "alibi_slopes",
                                               "alpha", "query_scale", "ssa_n", "ssa_b",    "ssmax_s",
                                               "past_key", "past_value", "past_length", "past_key_summary",
                                               "summary_length"};
enum OutputSlot { kO, kEntropy, kPresentKey, kPresentValue, kPresentKeySummary, kNumOutputs };
constexpr int64_t kPage = 16;        // keys per page of the key summary
constexpr int64_t kFirstPages = 8;   // sparse decode: pages read first, by bound, for the threshold's lower bound
constexpr int64_t kGrowPages = 4;    // read kGrowPages× more while a row keeps more than kGrowPages× the pages read
constexpr double kTauMargin = 1e-6;  // the lower bound lowered by this (relative): rounding can only keep a page
constexpr int kTauHalvings = 12;     // bisection's lower end after 12 halvings of [max u − 1, max u]: within 2.5e-4
constexpr int64_t kQueryTile = 64;  // query rows per task, over a GQA group's heads
constexpr int64_t kSkinnyRows = 8;       // at most this many stacked rows: block-wise matrix-vector products
constexpr int64_t kKeysPerPass = 512;    // keys per block there (128 KiB of K at D = 64: stays in L2)
constexpr int64_t kKeyBlock = 64;   // keys per P·V GEMM when entmax skips blocks without support
constexpr int kMaxThresholdPasses = 100;
constexpr double kFarFromRoot = 1.25;  // the threshold search steps on S^(1/k) above this S
constexpr double kSettledStep = 1e-3;  // a Halley step this small needs no pass to confirm it
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMatrix = Eigen::Map<const RowMajor>;
using Matrix = Eigen::Map<RowMajor>;
using StridedMatrix = Eigen::Map<RowMajor, Eigen::Aligned64, Eigen::OuterStride<>>;
using AlignedFloats = std::vector<float, Eigen::aligned_allocator<float>>;
constexpr int64_t kAlign = 16;  // floats: every logits row starts on a 64-byte boundary, in every thread, so
                                // vectorised reductions split rows identically whatever thread runs the tile
using Row = Eigen::Map<Eigen::ArrayXf>;
using Half = Eigen::half;  // an fp16 KV cache's element (the cache form's past_key/past_value may be float16)

// fp16 → fp32, n values: the CPU's conversion instructions where the build has them, else Eigen's bit arithmetic.
void widen(const Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// fp32 → fp16 (round to nearest even), n values.
void narrow(const float* src, Half* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = Half(src[i]);
}

void store(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }
void store(const float* src, Half* dst, int64_t n) { narrow(src, dst, n); }

struct Error : std::runtime_error {
  OrtErrorCode code;
  Error(OrtErrorCode c, const std::string& m) : std::runtime_error(m), code(c) {}
};

[[noreturn]] void invalid(const std::string& message) { throw Error(ORT_INVALID_ARGUMENT, "SharpAttention: " + message); }

void check(OrtStatus* status) {
  if (status == nullptr) return;
  const OrtApi& api = Ort::GetApi();
  std::string message = api.GetErrorMessage(status);
  OrtErrorCode code = api.GetErrorCode(status);
  api.ReleaseStatus(status);
  throw Error(code, message);
}

// `body`, with what it throws returned as a status: an op's errors never cross into ORT as C++ exceptions.
template <typename F>
OrtStatusPtr as_status(const char* op, F&& body) {
  try {
    body();
    return nullptr;
  } catch (const Error& e) {
    return Ort::GetApi().CreateStatus(e.code, e.what());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, (std::string(op) + ": " + e.what()).c_str());
  }
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

// ---- attributes ----------------------------------------------------------------------------------------------

struct Attributes {
  const NormEntry* norm = nullptr;
  bool causal = true;
  float scale = 1.0f;
  int64_t q_heads = 0, kv_heads = 0;
  std::vector<float> poly;
  float threshold = 0.5f;
  int param_slot[2] = {-1, -1};
};

template <typename T>
bool optional_attribute(const OrtKernelInfo* info, const char* name, T* out) {
  const OrtApi& api = Ort::GetApi();
  OrtStatus* status;
  if constexpr (std::is_same_v<T, float>) {
    status = api.KernelInfoGetAttribute_float(info, name, out);
  } else {
    status = api.KernelInfoGetAttribute_int64(info, name, out);
  }
  if (status != nullptr) {
    api.ReleaseStatus(status);
    return false;
  }
  return true;
}

Attributes read_attributes(const OrtKernelInfo* info) {
  Ort::ConstKernelInfo ki(info);
  Attributes a;
  std::string norm;
  try {
    norm = ki.GetAttribute<std::string>("norm");
  } catch (const Ort::Exception&) {
    invalid("the node has no 'norm' attribute");
  }
  for (const NormEntry& e : kNorms)
    if (norm == e.name) a.norm = &e;
  if (a.norm == nullptr) {
    std::string known;
    for (const NormEntry& e : kNorms) known += std::string(known.empty() ? "" : ", ") + e.name;
    invalid("unknown norm '" + norm + "'; this library implements " + known);
  }
  int64_t causal = 1;
  optional_attribute(info, "causal", &causal);
  a.causal = causal != 0;
  if (!optional_attribute(info, "q_heads", &a.q_heads) || !optional_attribute(info, "kv_heads", &a.kv_heads))
    invalid("the node needs integer attributes q_heads and kv_heads");
  if (a.q_heads < 1 || a.kv_heads < 1 || a.q_heads % a.kv_heads != 0)
    invalid("q_heads " + std::to_string(a.q_heads) + " must be a positive multiple of kv_heads " +
            std::to_string(a.kv_heads));
  a.scale = std::numeric_limits<float>::quiet_NaN();
  optional_attribute(info, "scale", &a.scale);  // absent: 1/sqrt(D), resolved at the first run
  optional_attribute(info, "threshold", &a.threshold);
  if (a.norm->transform == Transform::kEntropyBeta) {
    try {
      a.poly = ki.GetAttributes<float>("poly");
    } catch (const Ort::Exception&) {
      invalid("norm '" + norm + "' needs the 'poly' attribute");
    }
    if (a.poly.empty()) invalid("norm '" + norm + "' needs a non-empty 'poly' attribute");
  }
  for (int p = 0; p < a.norm->num_params; ++p) {
    for (int s = 0; s < kNumSlots; ++s)
      if (std::strcmp(kSlotNames[s], a.norm->params[p]) == 0) a.param_slot[p] = s;
    if (a.param_slot[p] < 0) invalid(std::string("no input slot named ") + a.norm->params[p]);
  }
  return a;
}

// ---- inputs --------------------------------------------------------------------------------------------------

struct Tensor {
  const void* data = nullptr;
  std::vector<int64_t> shape;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  bool given = false;  // false: the slot is omitted (empty name, or past the node's inputs)
  bool present() const { return given; }
  const float* f() const { return static_cast<const float*>(data); }
};

Tensor input(OrtKernelContext* ctx, size_t count, int slot) {
  Tensor t;
  if (static_cast<size_t>(slot) >= count) return t;
  const OrtApi& api = Ort::GetApi();
  const OrtValue* value = nullptr;
  check(api.KernelContext_GetInput(ctx, slot, &value));
  if (value == nullptr) return t;
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(api.GetTensorTypeAndShape(value, &info));
  size_t rank = 0;
  OrtStatus* status = api.GetDimensionsCount(info, &rank);
  if (status == nullptr) {
    t.shape.resize(rank);
    status = api.GetDimensions(info, t.shape.data(), rank);
  }
  if (status == nullptr) status = api.GetTensorElementType(info, &t.type);
  api.ReleaseTensorTypeAndShapeInfo(info);
  check(status);
  void* data = nullptr;
  check(api.GetTensorMutableData(const_cast<OrtValue*>(value), &data));  // read only
  t.data = data;
  t.given = true;
  return t;
}

void expect_shape(const Tensor& t, int slot, const std::vector<int64_t>& want) {
  if (t.shape != want)
    invalid(std::string("input ") + kSlotNames[slot] + " has shape " + shape_string(t.shape) + ", expected " +
            shape_string(want));
}

// ---- one problem ---------------------------------------------------------------------------------------------

struct Problem {
  const Attributes* a;
  const float *q, *k, *v, *alibi, *query_scale;
  const Half *k16, *v16;  // an fp16 cache's K and V (then k and v are null): widened a block at a time
  const bool* key_mask;
  const char* mask_full;  // per batch row: key_mask is all true (the common case: no padding)
  const float* param[2];
  int64_t batch, hq, hkv, lq, lk, d, dv, tiles, tile_rows;
  int64_t kstride;  // keys between one (batch, KV head)'s K/V rows and the next: lk, or the cache form's buffer
  const float* summary;   // the cache's key summary (batch, KV head, pages, 2, D), or null: no page is skipped
  int64_t summary_pages;  // pages between one (batch, KV head)'s summary and the next
  float scale;
  float *out, *entropy;
};

struct Workspace {  // one per thread, grown on demand and reused (no allocation per tile once warm)
  AlignedFloats logits, shifted, stack;  // stack: a GQA group's query rows, then its output rows
  AlignedFloats candidates;        // entmax: the u, then the weights, of the keys that may carry weight
  std::vector<int32_t> cand_keys;  // and their indices in the row
  AlignedFloats kv_block;  // an fp16 cache's keys or values, a block of them widened to fp32
  std::vector<double> row_sum;
  std::vector<char> live_block;
  // decode (few rows): each entmax row's support as (key, weight) pairs, its values then read for those keys only
  std::vector<std::vector<int32_t>> support_keys;
  std::vector<AlignedFloats> support_weights;
  std::vector<char> sparse_row;
  // sparse entmax decode: each row's bound on every page, the pages whose keys were read, an order of pages
  std::vector<double> page_bound;
  AlignedFloats page_abs, page_dot;  // the summary's per-dimension max |k| of each page; hi, lo and |q|·max|k|
  std::vector<char> page_read;
  std::vector<int32_t> page_order;
  std::vector<double> support_u;
};
thread_local Workspace tls_workspace;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// A row whose max is not finite: −inf (nothing visible) gives zeros; +inf or NaN gives NaN (docs/attention.md).
// Returns the row sum to record, or 1 (a placeholder) when the row is usable.
bool degenerate_row(Row r, float max, float* entropy, float* sum) {
  if (std::isfinite(max)) return false;
  const float fill = max == kNegInf ? 0.0f : kNaN;
  r.setConstant(fill);
  *entropy = fill;
  *sum = fill;
  return true;
}

// ---- row passes: Eigen's packet math, so exp and log run vectorised (Eigen 3.4 never vectorises `select`, and
// a select around exp() falls back to scalar libm) ----
namespace ei = Eigen::internal;
using Packet = ei::packet_traits<float>::type;
constexpr int64_t kLanes = ei::unpacket_traits<Packet>::size;

// f over src[0, n) packet by packet, results to dst[0, n) (may equal src). Rows start 64-byte aligned; the last
// partial packet goes through a buffer padded with −inf (every pass below maps −inf to −inf or to a zero weight).
template <typename F>
void map_row(const float* src, float* dst, int64_t n, F&& f) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) ei::pstore(dst + j, f(ei::pload<Packet>(src + j)));
  if (j < n) {
    alignas(64) float tail[kLanes];
    std::fill(tail, tail + kLanes, kNegInf);
    std::copy(src + j, src + n, tail);
    ei::pstore(tail, f(ei::pload<Packet>(tail)));
    std::copy(tail, tail + (n - j), dst + j);
  }
}

// f over src[0, n) packet by packet, reading only (the same −inf-padded last packet as map_row).
template <typename F>
void scan_row(const float* src, int64_t n, F&& f) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) f(ei::pload<Packet>(src + j));
  if (j < n) {
    alignas(64) float tail[kLanes];
    std::fill(tail, tail + kLanes, kNegInf);
    std::copy(src + j, src + n, tail);
    f(ei::pload<Packet>(tail));
  }
}

Packet visible(Packet x) { return ei::pcmp_lt(ei::pset1<Packet>(kNegInf), x); }  // all ones where x > −inf

// The softmax family's per-key transform of z[0, n) in place (−inf stays −inf): SSMax's p0·log(visible keys)
// factor, or sign(t)·p0·log(1 + p1·|t|); the other transforms leave z as it is.
void transform_row(Transform transform, float* z, int64_t n, float p0, float p1, int64_t visible_keys) {
  switch (transform) {
    case Transform::kLogNScale: {
      const Packet factor = ei::pset1<Packet>(p0 * std::log(static_cast<float>(std::max<int64_t>(visible_keys, 1))));
      map_row(z, z, n, [&](Packet x) { return ei::pselect(visible(x), ei::pmul(x, factor), x); });
      break;
    }
    case Transform::kSignedLog: {
      const Packet vp0 = ei::pset1<Packet>(p0), vp1 = ei::pset1<Packet>(p1), one = ei::pset1<Packet>(1.0f);
      const Packet sign_bit = ei::pset1<Packet>(-0.0f);
      map_row(z, z, n, [&](Packet x) {
        const Packet y = ei::pmul(vp0, ei::plog(ei::padd(ei::pmul(ei::pabs(x), vp1), one)));
        return ei::pselect(visible(x), ei::pxor(y, ei::pand(x, sign_bit)), x);
      });
      break;
    }
    case Transform::kEntropyBeta:
    case Transform::kIdentity:
    case Transform::kNone:
      break;
  }
}

// max of z[0, n): NaN if any entry is NaN (the row is then degenerate).
float row_max(const float* z, int64_t n) {
  Packet m = ei::pset1<Packet>(kNegInf);
  scan_row(z, n, [&](Packet x) { m = ei::pmax<Eigen::PropagateNaN>(m, x); });
  alignas(64) float lanes[kLanes];
  ei::pstore(lanes, m);
  float out = kNegInf;
  for (float v : lanes) out = std::isnan(v) || std::isnan(out) ? kNaN : std::max(out, v);
  return out;
}

// dst = e^{x}, x = β (src − m), over [0, n) (−inf → exactly 0); returns Λ = Σ dst and writes K' = Σ dst · x, the
// two sums of the max-relative entropy log Λ − K'/Λ.
float exp_pass(const float* src, float* dst, int64_t n, float m, float beta, float* kp) {
  const Packet vm = ei::pset1<Packet>(m), vb = ei::pset1<Packet>(beta);
  Packet lam = ei::pset1<Packet>(0.0f), k = lam;
  map_row(src, dst, n, [&](Packet t) {
    const Packet x = ei::pmul(ei::psub(t, vm), vb), live = visible(x);
    const Packet e = ei::pand(live, ei::pexp(x));
    lam = ei::padd(lam, e);
    k = ei::padd(k, ei::pand(live, ei::pmul(e, x)));
    return e;
  });
  *kp = ei::predux(k);
  return ei::predux(lam);
}

// β(H) of the adaptive norm: max(poly(H), 1) above the threshold, else 1 (poly highest power first).
float adaptive_beta(const Attributes& a, float h) {
  if (!(h > a.threshold)) return 1.0f;
  float acc = 0.0f;
  for (float c : a.poly) acc = acc * h + c;
  return std::max(acc, 1.0f);
}

// One safeguarded step of the entmax threshold search for S(τ) = Σ [u − τ]_+^k = 1 (k = 1/(α−1)), given S, its
// sums s1 = Σ d^(k−1), s2 = Σ d^(k−2) (Halley's rows) or T = Σ d^(k+1) (Newton's; 0 where not summed) and the
// previous pass's (τ, S'); the Triton kernels' `_refine` (docs/kernels.md): Halley where S'' is summed (k ≥ 2),
// Newton otherwise; on h = S^(1/k) − 1 while S > 1.25 (for k < 2 the root of a power law A·(c − τ)^p through S and
// S', p from T·S'/S² = −(k+1)·p/(p+1));
// near the root for 1 < k < 2 a Halley step with S'' from the change in S' since the previous pass; bisection
// when a step leaves the bracket (or, for k < 1, crosses over half of it). Returns whether τ has converged: a step
// within 4 ulp, or a small Halley step whose error (cubed, or as the secant curvature estimates it) is below that.
struct Threshold {
  double k, lo, hi, tau, prev_tau, prev_fp = 0.0;  // prev_tau = tau before the first pass: no finite curvature

  bool step(double s, double s1, double s2) {
    const double eps4 = 4.0 * std::numeric_limits<float>::epsilon();
    const double f = s - 1.0, fp = -k * s1;
    if (f > 0) {
      lo = tau;
    } else {
      hi = tau;
    }
    double dt;
    bool settles = false;
    if (s > kFarFromRoot) {
      if (k >= 2.0) {
        const double r = std::pow(s, 1.0 / k), hq = (r - 1.0) * s;
        dt = -2.0 * hq * s1 / (2.0 * r * s1 * s1 - (r - 1.0) * (k - 1.0) * (s * s2 - s1 * s1));
      } else {  // for a power law, T = (k+1)·∫S gives T·S'/S² = −(k+1)·p/(p+1); p = k is Newton's step on h
        const double q = -s2 * fp / ((k + 1.0) * s * s);
        double p = q / (1.0 - q);
        p = p > 0.0 && std::isfinite(p) ? std::clamp(p, k, 4.0 * k) : k;
        dt = p * (s / fp) * (1.0 - std::pow(s, -1.0 / p));
      }
    } else if (k >= 2.0) {
      const double fpp = k * (k - 1.0) * s2;
      dt = 2.0 * f * fp / (2.0 * fp * fp - f * fpp);
      settles = std::abs(dt) <= kSettledStep;
    } else {
      dt = f / fp;
      const double curv = (fp - prev_fp) / (tau - prev_tau);
      if (k > 1.0 && curv >= 0.0 && std::isfinite(curv)) {
        const double sec = 2.0 * f * fp / (2.0 * fp * fp - f * curv);
        if (std::isfinite(sec)) {
          dt = sec;
          settles = std::abs(dt) <= kSettledStep && std::abs(curv / fp) * dt * dt <= eps4 / 4.0;
        }
      }
    }
    double next = tau - dt;
    const bool cycling = k < 1.0 && std::abs(next - tau) > 0.5 * (hi - lo);
    const bool ok = std::isfinite(next) && next >= lo && next <= hi && !cycling;
    if (!ok) next = 0.5 * (lo + hi);
    const bool done = std::abs(next - tau) <= eps4 || f == 0.0 || hi - lo <= eps4 || (ok && settles);
    prev_tau = tau;
    prev_fp = fp;
    tau = next;
    return done;
  }
};

// A floor c ≥ −1 on entmax's threshold τ* of row z[0, n), from how many keys lie above the levels −2^{−i}
// (i = 1…10) in u = (α−1)(z − max z), counted on every 4th packet: any subset's S(c) = Σ [u − c]_+^k is at most
// the row's, and a key above a level weighs at least (level − c)^k, so where that lower estimate of S(c) is ≥ 1,
// S(τ*) = 1 puts τ* ≥ c and no key with u ≤ c has weight. The highest such level, else −1. (AVX-512 only;
// elsewhere −1, the bound every row has.) For a flat row this leaves the threshold search the keys near the top
// instead of nearly all of them.
float entmax_floor(const float* z, int64_t n, float zmax, float am1, double k) {
#if defined(__AVX512F__)
  constexpr int kLevels = 10;
  int64_t above[kLevels + 1] = {0};  // above[i]: sampled keys with u > −2^{−i}
  int64_t tops = 0;                   // sampled keys at u = 0
  const __m512 vmax = _mm512_set1_ps(zmax), va = _mm512_set1_ps(am1), zero = _mm512_setzero_ps();
  __m512 level[kLevels + 1];
  for (int i = 1; i <= kLevels; ++i) level[i] = _mm512_set1_ps(-std::ldexp(1.0f, -i));
  for (int64_t j = 0; j + 16 <= n; j += 64) {
    const __m512 u = _mm512_mul_ps(va, _mm512_sub_ps(_mm512_loadu_ps(z + j), vmax));
    if (_mm512_cmp_ps_mask(level[1], u, _CMP_LT_OQ) == 0) continue;
    tops += __builtin_popcount(_mm512_cmp_ps_mask(u, zero, _CMP_GE_OQ));
    for (int i = 1; i <= kLevels; ++i) above[i] += __builtin_popcount(_mm512_cmp_ps_mask(level[i], u, _CMP_LT_OQ));
  }
  for (int j = kLevels; j >= 1; --j) {  // the highest level c = −2^{−j} whose estimate reaches 1
    const double c = -std::ldexp(1.0, -j);
    // the row's maximum (u = 0) weighs (−c)^k: added unless a key at u = 0 was sampled (it may be that one)
    double est = tops == 0 ? std::pow(-c, k) : 0.0;
    for (int i = kLevels; i > j; --i) {
      const int64_t band = above[i] - (i < kLevels ? above[i + 1] : 0);
      est += static_cast<double>(band) * std::pow(-std::ldexp(1.0, -i) - c, k);
    }
    if (est >= 1.0 + 1e-6) return static_cast<float>(c);
  }
#else
  (void)z, (void)n, (void)zmax, (void)am1, (void)k;
#endif
  return -1.0f;
}

// The keys of row z[0, n) that may carry entmax weight, u = (α−1)(z − max z) > floor (≥ −1): their u to cand and
// their indices to keys, in key order; returns how many, and counts the visible keys (z > −inf) into *visible.
// AVX-512 stores a packet's candidates with one compress; elsewhere, key by key where a packet holds any.
int64_t gather_candidates(const float* z, int64_t n, float zmax, float am1, float lowest, float* cand,
                          int32_t* keys, int64_t* visible) {
  int64_t m = 0, j = 0, seen = 0;
#if defined(__AVX512F__)
  const __m512 vmax = _mm512_set1_ps(zmax), va = _mm512_set1_ps(am1), floor = _mm512_set1_ps(lowest);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_loadu_ps(z + j);
    seen += __builtin_popcount(_mm512_cmp_ps_mask(neg_inf, x, _CMP_LT_OQ));
    const __m512 u = _mm512_mul_ps(va, _mm512_sub_ps(x, vmax));
    const __mmask16 take = _mm512_cmp_ps_mask(floor, u, _CMP_LT_OQ);
    if (take == 0) continue;
    _mm512_mask_compressstoreu_ps(cand + m, take, u);
    _mm512_mask_compressstoreu_epi32(keys + m, take, _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(j))));
    m += __builtin_popcount(take);
  }
#endif
  for (; j < n; ++j) {
    seen += z[j] > kNegInf;
    const float u = am1 * (z[j] - zmax);
    if (u > lowest) {
      keys[m] = static_cast<int32_t>(j);
      cand[m++] = u;
    }
  }
  *visible = seen;
  return m;
}

// Keeps the candidates with u ≥ floor, in order; returns how many (AVX-512: a compress per packet).
int64_t keep_at_least(float* cand, int32_t* keys, int64_t m, float floor) {
  int64_t out = 0, j = 0;
#if defined(__AVX512F__)
  const __m512 f = _mm512_set1_ps(floor);
  for (; j + 16 <= m; j += 16) {
    const __m512 u = _mm512_loadu_ps(cand + j);
    const __m512i k = _mm512_loadu_si512(keys + j);
    const __mmask16 keep = _mm512_cmp_ps_mask(u, f, _CMP_GE_OQ);
    _mm512_mask_compressstoreu_ps(cand + out, keep, u);  // out ≤ j: never ahead of what is still to be read
    _mm512_mask_compressstoreu_epi32(keys + out, keep, k);
    out += __builtin_popcount(keep);
  }
#endif
  for (; j < m; ++j)
    if (cand[j] >= floor) {
      keys[out] = keys[j];
      cand[out++] = cand[j];
    }
  return out;
}

// α-entmax of row z[0, n), α = 1 + am1, over u = (α−1)(z − max z): weights p = [u − τ]_+^{1/(α−1)}, unnormalised.
// τ ≥ c (−1, or entmax_floor's higher level) and only keys with u > c can carry weight: their indices go to
// ws.cand_keys and their u to ws.candidates (m of them, returned in *m), the threshold search runs over those alone
// (τ by `Threshold` inside the bracket [c, −n^{1−α}]), and their weights replace their u there. z is only read:
// what no candidate holds is zero, so a caller reads the values of the candidates only (exactly: every other key's
// weight is 0). A row whose max is not finite is filled as degenerate_row says and has no candidates. Returns
// Z = Σ p and writes the entropy log Z − Σ p log p / Z.
float entmax_row(float* z, int64_t n, float am1, float* entropy, Workspace& ws, int64_t* m_out) {
  *m_out = 0;
  const float zmax = row_max(z, n);
  float zsum;
  if (degenerate_row(Row(z, n), zmax, entropy, &zsum)) return zsum;
  const double inv = 1.0 / am1;
  const Packet zero = ei::pset1<Packet>(0.0f), one = ei::pset1<Packet>(1.0f);
  if (static_cast<int64_t>(ws.candidates.size()) < n) {
    ws.candidates.resize(n);
    ws.cand_keys.resize(n);
  }
  float* cand = ws.candidates.data();
  int32_t* keys = ws.cand_keys.data();
  int64_t visible_keys = 0;
  const float lowest = entmax_floor(z, n, zmax, am1, inv);
  int64_t m = gather_candidates(z, n, zmax, am1, lowest, cand, keys, &visible_keys);
  const Packet e0 = ei::pset1<Packet>(static_cast<float>(inv));
  // The general power's one exp: b = d^e, e = k − 2 where Halley reads S'' (k ≥ 2), else k − 1 (S'' unused); the
  // sums are b·d², b·d, b (as the Triton kernels' `_powers`).
  const bool halley = inv >= 2.0;
  const Packet ep = ei::pset1<Packet>(static_cast<float>(halley ? inv - 2.0 : inv - 1.0));
  const double hi0 = -std::pow(static_cast<double>(visible_keys), -static_cast<double>(am1));
  Threshold th{inv, lowest, hi0, lowest, lowest};
  for (int pass = 0; pass < kMaxThresholdPasses; ++pass) {
    const Packet vt = ei::pset1<Packet>(static_cast<float>(th.tau));
    Packet ps = zero, ps1 = zero, ps2 = zero;  // S + 1 and the sums of its derivatives (padding: d = 0)
    scan_row(cand, m, [&](Packet c) {
      const Packet d = ei::pmax(ei::psub(c, vt), zero), live = ei::pcmp_lt(zero, d);
      if (inv == 2.0) {  // α = 1.5: d², d, 1
        ps = ei::pmadd(d, d, ps);
        ps1 = ei::padd(ps1, d);
        ps2 = ei::padd(ps2, ei::pand(live, one));
      } else if (inv == 1.0) {  // α = 2: d, 1 (Newton)
        ps = ei::padd(ps, d);
        ps1 = ei::padd(ps1, ei::pand(live, one));
      } else if (ei::predux_any(live) && inv < 1.0) {  // α > 2: d^k and d^(k−1) each from log d — S as
        const Packet ld = ei::plog(d);                       // d^(k−1)·d moved τ across a near-tie (tested)
        ps = ei::padd(ps, ei::pand(live, ei::pexp(ei::pmul(ld, e0))));
        ps1 = ei::padd(ps1, ei::pand(live, ei::pexp(ei::pmul(ld, ep))));
      } else if (ei::predux_any(live)) {  // b = d^e from log d, masked (d = 0: log d = −inf), then its products
        const Packet b = ei::pand(live, ei::pexp(ei::pmul(ei::plog(d), ep))), bd = ei::pmul(b, d);
        ps = ei::pmadd(bd, d, ps);
        ps1 = ei::padd(ps1, bd);
        ps2 = ei::padd(ps2, b);
      }
    });
    double s = ei::predux(ps), s1 = ei::predux(ps1), s2 = ei::predux(ps2);
    if (inv > 1.0 && !halley) {  // Newton's rows of the b path: b = d^(k−1), so S = Σ b·d, S' ∝ Σ b, T = Σ b·d²
      std::swap(s, s1);
      std::swap(s1, s2);
    }
    const double lo = th.lo;
    if (th.step(s, s1, s2)) break;
    // The bracket's low end only rises, and every τ from here on lies at or above it: a candidate below it has
    // d = 0 in every later sum and in the weights, so it leaves the candidates (which changes no result).
    if (th.lo > lo) m = keep_at_least(cand, keys, m, static_cast<float>(th.lo));
  }
  const double tau = th.tau;
  // p = [u − τ]_+^inv (masked: −inf − τ clamps to 0), Z = Σ p and Σ p log p over the candidates.
  const Packet vt = ei::pset1<Packet>(static_cast<float>(tau));
  Packet pz = zero, pl = zero;
  map_row(cand, cand, m, [&](Packet u) {
    const Packet d = ei::pmax(ei::psub(u, vt), zero), live = ei::pcmp_lt(zero, d);
    if (!ei::predux_any(live)) return zero;  // candidates below τ: no transcendentals
    Packet w = d;
    if (inv != 2.0 && inv != 1.0) {  // log w = k·log d: one log and one exp per packet
      const Packet lw = ei::pmul(ei::plog(d), e0);
      w = ei::pand(live, ei::pexp(lw));
      pz = ei::padd(pz, w);
      pl = ei::padd(pl, ei::pand(live, ei::pmul(w, lw)));
      return w;
    }
    if (inv == 2.0) w = ei::pmul(d, d);
    pz = ei::padd(pz, w);
    pl = ei::padd(pl, ei::pand(ei::pcmp_lt(zero, w), ei::pmul(w, ei::plog(w))));
    return w;
  });
  zsum = ei::predux(pz);
  const float plogp = ei::predux(pl);
  *entropy = std::log(zsum) - plogp / zsum;
  *m_out = m;
  return zsum;
}

// ---- sparse entmax decode -----------------------------------------------------------------------------------
// α-entmax weighs key j by [u_j − τ*]_+^{1/(α−1)}, u = (α−1)·z. On any subset of the keys, the threshold τ_S that
// normalises the subset alone is ≤ τ* (S(τ) = Σ [u − τ]_+^k grows with the keys and falls with τ), so a key with
// u_j ≤ τ_S weighs exactly 0, and so does every key of a page whose bound on u is ≤ τ_S. The bound comes from the
// cache's key summary, per page and dimension the stored keys' minimum and maximum: q·k ≤ Σ_d max(q_d·kmin_d,
// q_d·kmax_d) (the lower bound where λ < 0), ALiBi's term at the page's first or last key, raised by the rounding
// a float dot product can make. A decode row bounds every page (2·D numbers a page), reads the kFirstPages pages
// with the highest bounds and the query's own page, takes a lower bound of τ_S on the keys read, and keeps the
// pages whose bound is above it — reading kGrowPages× more of the best pages first while a row keeps more than
// kGrowPages× the pages read and the last, larger read at least halved what the rows keep. Then the kept pages' keys are read; every other key's logit is −inf, so entmax_row's
// threshold over the rest is τ* itself and the output and entropy are dense entmax's (docs/op.md).

// A lower bound of the threshold of the keys u (finite): bisection between max u − 1 (the largest key alone gives
// S ≥ 1) and max u, keeping the end where S ≥ 1 (a bound after any number of halvings; kTauHalvings of them keep
// a row of thousands of candidates cheap), lowered by kTauMargin. −inf when there are no keys.
double threshold_floor(std::vector<double>& u, double k) {
  if (u.empty()) return -std::numeric_limits<double>::infinity();
  double hi = *std::max_element(u.begin(), u.end()), lo = hi - 1.0;
  u.erase(std::remove_if(u.begin(), u.end(), [lo](double x) { return x <= lo; }), u.end());  // 0 at every τ ≥ lo
  for (int it = 0; it < kTauHalvings; ++it) {
    const double mid = 0.5 * (lo + hi);
    double sum = 0.0;
    for (const double x : u)
      if (x > mid) sum += k == 2.0 ? (x - mid) * (x - mid) : std::pow(x - mid, k);
    (sum >= 1.0 ? lo : hi) = mid;
  }
  return lo - kTauMargin * std::max(1.0, std::abs(lo));
}

// The decode rows g < group (query heads h0 + g, one query at position kend − 1) of one (batch, KV head) whose
// normaliser is entmax with every α > 1: the raw dot products q·k of the pages that can carry weight go to s, 0 to
// the others, and ws.page_read marks the pages read. `keys(j0, len, buf)` gives keys [j0, j0 + len) as fp32 rows.
template <typename Keys>
void read_kept_pages(const Problem& p, int64_t b, int64_t kvh, int64_t kend, const ConstMatrix& q, StridedMatrix& s,
                     Workspace& ws, const Keys& keys) {
  const int64_t group = p.hq / p.hkv, h0 = kvh * group, pages = (kend + kPage - 1) / kPage, d = p.d;
  const int64_t pos = kend - 1;
  const float* summary = p.summary + (b * p.hkv + kvh) * p.summary_pages * 2 * d;
  const bool* mask = p.key_mask != nullptr && !p.mask_full[b] ? p.key_mask + b * p.lk : nullptr;
  // the rounding of the kernel's float dot products and of the bound's own, relative to Σ_d |q_d|·max|k_d|
  const double slack = static_cast<double>(d + 4) * 1.2e-7;
  double am1[kSkinnyRows], lam[kSkinnyRows], slope[kSkinnyRows], tau[kSkinnyRows];
  ws.page_bound.resize(static_cast<size_t>(group * pages));
  // Σ_d max(q_d·kmin_d, q_d·kmax_d) = q⁻·kmin + q⁺·kmax: one matrix-vector product over the (pages, 2D) summary
  // (and q⁺·kmin + q⁻·kmax for the lower bound); the rounding allowance scales with Σ_d |q_d|·max(|kmin_d|, |kmax_d|)
  const ConstMatrix sum(summary, pages, 2 * d);
  ws.page_abs.resize(static_cast<size_t>(pages * d));
  Matrix absmax(ws.page_abs.data(), pages, d);
  absmax = sum.leftCols(d).cwiseAbs().cwiseMax(sum.rightCols(d).cwiseAbs());
  ws.page_dot.resize(static_cast<size_t>(3 * pages));
  Eigen::Map<Eigen::VectorXf> hi_v(ws.page_dot.data(), pages), lo_v(ws.page_dot.data() + pages, pages),
      mag_v(ws.page_dot.data() + 2 * pages, pages);
  Eigen::VectorXf w(2 * d);
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = h0 + g;
    am1[g] = static_cast<double>(p.param[0][h]) - 1.0;
    lam[g] = p.query_scale != nullptr ? p.query_scale[(b * p.hq + h) * p.lq] : 1.0;
    slope[g] = p.alibi != nullptr ? p.alibi[h] : 0.0;
    const Eigen::VectorXf qg = q.row(g).transpose();
    w << qg.cwiseMin(0.0f), qg.cwiseMax(0.0f);
    hi_v.noalias() = sum * w;
    if (lam[g] < 0) {
      w << qg.cwiseMax(0.0f), qg.cwiseMin(0.0f);
      lo_v.noalias() = sum * w;
    }
    mag_v.noalias() = absmax * qg.cwiseAbs();
    for (int64_t page = 0; page < pages; ++page) {
      const double hi = hi_v[page], lo = lo_v[page], mag = mag_v[page];
      const double first = static_cast<double>(page * kPage - pos);
      const double last = static_cast<double>(std::min(page * kPage + kPage, kend) - 1 - pos);
      const double at_hi = std::max(slope[g] * first, slope[g] * last), at_lo = std::min(slope[g] * first, slope[g] * last);
      const double z = lam[g] >= 0 ? lam[g] * (p.scale * hi + at_hi) : lam[g] * (p.scale * lo + at_lo);
      const double err = std::abs(lam[g]) * (p.scale * mag + std::abs(at_lo) + std::abs(at_hi)) * slack;
      ws.page_bound[g * pages + page] = am1[g] * (z + err);
    }
  }
  // page_read: 0 not read, 1 to read, 2 read
  ws.page_read.assign(static_cast<size_t>(pages), 0);
  const auto read_marked = [&] {
    for (int64_t page = 0; page < pages;) {
      if (ws.page_read[page] != 1) {
        ++page;
        continue;
      }
      int64_t end = page;
      while (end < pages && ws.page_read[end] == 1 && (end - page) * kPage < kKeysPerPass) ws.page_read[end++] = 2;
      const int64_t j0 = page * kPage, len = std::min(end * kPage, kend) - j0;
      const ConstMatrix kb = keys(j0, len, ws.kv_block);
      for (int64_t g = 0; g < group; ++g) s.row(g).segment(j0, len).noalias() = q.row(g) * kb.transpose();
      page = end;
    }
  };
  ws.page_order.resize(static_cast<size_t>(pages));
  int64_t before = -1;  // pages the rows kept after the previous read
  for (int64_t read = std::min(kFirstPages, pages);; read = std::min(pages, read * kGrowPages)) {
    for (int64_t g = 0; g < group; ++g) {  // each row's `read` best pages, and the query's own page
      const double* bound = ws.page_bound.data() + g * pages;
      std::iota(ws.page_order.begin(), ws.page_order.end(), 0);
      std::nth_element(ws.page_order.begin(), ws.page_order.begin() + (read - 1), ws.page_order.end(),
                       [bound](int32_t x, int32_t y) { return bound[x] > bound[y]; });
      for (int64_t r = 0; r < read; ++r) ws.page_read[ws.page_order[r]] = std::max<char>(ws.page_read[ws.page_order[r]], 1);
    }
    ws.page_read[pages - 1] = std::max<char>(ws.page_read[pages - 1], 1);
    read_marked();
    bool grow = false;
    int64_t kept = 0;
    for (int64_t g = 0; g < group; ++g) {  // τ_S's lower bound over every key read, then the pages it keeps
      ws.support_u.clear();
      for (int64_t page = 0; page < pages; ++page) {
        if (ws.page_read[page] != 2) continue;
        for (int64_t j = page * kPage; j < std::min(page * kPage + kPage, kend); ++j) {
          if (mask != nullptr && !mask[j]) continue;
          const double z = lam[g] * (p.scale * static_cast<double>(s(g, j)) + slope[g] * static_cast<double>(j - pos));
          ws.support_u.push_back(am1[g] * z);
        }
      }
      tau[g] = threshold_floor(ws.support_u, 1.0 / am1[g]);
      const double* bound = ws.page_bound.data() + g * pages;
      const int64_t row_kept = std::count_if(bound, bound + pages, [&](double x) { return x > tau[g]; });
      grow |= row_kept > kGrowPages * read;
      kept += row_kept;
    }
    if (!grow || read == pages || (before >= 0 && 2 * kept > before)) break;
    before = kept;
  }
  for (int64_t page = 0; page < pages; ++page)
    for (int64_t g = 0; g < group && ws.page_read[page] == 0; ++g)
      if (ws.page_bound[g * pages + page] > tau[g]) ws.page_read[page] = 1;
  read_marked();
  for (int64_t page = 0; page < pages; ++page)  // finite until entmax's rows hide them (−inf after the scaling)
    if (ws.page_read[page] == 0)
      for (int64_t g = 0; g < group; ++g) s.row(g).segment(page * kPage, kPage).setZero();
}

// A task is one (batch, KV head, query tile): the tile's rows of every query head sharing that KV head, stacked
// (GQA), so K and V are read once per group instead of once per query head.
void run_tile(const Problem& p, int64_t task) {
  const Attributes& a = *p.a;
  const int64_t tile = task % p.tiles, bk = task / p.tiles, kvh = bk % p.hkv, b = bk / p.hkv;
  const int64_t group = p.hq / p.hkv, h0 = kvh * group;
  const int64_t r0 = tile * p.tile_rows, r1 = std::min(p.lq, r0 + p.tile_rows), rows = r1 - r0;
  const int64_t stacked = group * rows;  // row i: query head h0 + i / rows, query row r0 + i % rows
  const int64_t offset = p.lk - p.lq;    // query row r sits at position offset + r
  const int64_t kend = a.causal ? std::min(p.lk, offset + r1) : p.lk;
  const auto head_rows = [&](int64_t g) { return (b * p.hq + h0 + g) * p.lq + r0; };  // first row of head h0 + g
  if (kend == 0) {
    for (int64_t g = 0; g < group; ++g) {
      std::fill(p.out + head_rows(g) * p.dv, p.out + (head_rows(g) + rows) * p.dv, 0.0f);
      std::fill(p.entropy + head_rows(g), p.entropy + head_rows(g) + rows, 0.0f);
    }
    return;
  }
  Workspace& ws = tls_workspace;
  const int64_t stride = (kend + kAlign - 1) / kAlign * kAlign;
  ws.logits.resize(static_cast<size_t>(stacked * stride));
  ws.row_sum.resize(stacked);
  ws.shifted.resize(stride);
  ws.stack.resize(static_cast<size_t>(stacked * std::max(p.d, p.dv)));
  // Each head's rows are contiguous in Q: one head needs no copy, a group is stacked into the workspace.
  const float* qs = p.q + head_rows(0) * p.d;
  if (group > 1) {
    for (int64_t g = 0; g < group; ++g)
      std::copy(p.q + head_rows(g) * p.d, p.q + (head_rows(g) + rows) * p.d, ws.stack.data() + g * rows * p.d);
    qs = ws.stack.data();
  }
  StridedMatrix s(ws.logits.data(), stacked, kend, Eigen::OuterStride<>(stride));
  ConstMatrix q(qs, stacked, p.d);
  // Keys (values) [j0, j0 + len) of this (batch, KV head) as fp32 rows: the cache's own memory, or an fp16 cache's
  // rows widened into `buf` (a block at a time in the loops below, so the widened copy stays in cache).
  const int64_t first = (b * p.hkv + kvh) * p.kstride;
  const auto rows_of = [&](const float* f32, const Half* f16, int64_t dim, int64_t j0, int64_t len,
                           AlignedFloats& buf) -> const float* {
    if (f16 == nullptr) return f32 + (first + j0) * dim;
    buf.resize(static_cast<size_t>(len * dim));
    widen(f16 + (first + j0) * dim, buf.data(), len * dim);
    return buf.data();
  };
  const auto keys = [&](int64_t j0, int64_t len, AlignedFloats& buf) {
    return ConstMatrix(rows_of(p.k, p.k16, p.d, j0, len, buf), len, p.d);
  };
  const auto values = [&](int64_t j0, int64_t len, AlignedFloats& buf) {
    return ConstMatrix(rows_of(p.v, p.v16, p.dv, j0, len, buf), len, p.dv);
  };
  // Few rows (decode): one matrix-vector product per row, a block of keys at a time, so each block is read from
  // memory once for the whole group (a GEMM would pack all of K for a handful of rows).
  const bool skinny = stacked <= kSkinnyRows;
  // sparse entmax decode (above): one query per row, entmax with α > 1 on every row of the group, a key summary
  bool paged = skinny && p.summary != nullptr && p.lq == 1 && a.norm->family == Family::kEntmax &&
               (kend + kPage - 1) / kPage > kFirstPages;
  for (int64_t g = 0; paged && g < group; ++g) paged = p.param[0][h0 + g] > 1.0f;
  if (paged) {
    read_kept_pages(p, b, kvh, kend, q, s, ws, keys);
  } else if (skinny) {
    for (int64_t j0 = 0; j0 < kend; j0 += kKeysPerPass) {
      const int64_t len = std::min(kKeysPerPass, kend - j0);
      const ConstMatrix kb = keys(j0, len, ws.kv_block);
      for (int64_t i = 0; i < stacked; ++i) s.row(i).segment(j0, len).noalias() = q.row(i) * kb.transpose();
    }
  } else if (p.k16 == nullptr) {
    s.noalias() = q * keys(0, kend, ws.kv_block).transpose();
  } else {  // an fp16 cache: one GEMM per block of widened keys (the block stays in cache; all of K would not)
    for (int64_t j0 = 0; j0 < kend; j0 += kKeysPerPass) {
      const int64_t len = std::min(kKeysPerPass, kend - j0);
      s.middleCols(j0, len).noalias() = q * keys(j0, len, ws.kv_block).transpose();
    }
  }

  const bool* mask = p.key_mask ? p.key_mask + b * p.lk : nullptr;
  bool any_entmax = false, any_dense = false;  // rows with a sparse support / rows normalised over every key
  const int64_t blocks = (kend + kKeyBlock - 1) / kKeyBlock;
  if (skinny) {
    ws.sparse_row.assign(stacked, 0);
    if (static_cast<int64_t>(ws.support_keys.size()) < stacked) {
      ws.support_keys.resize(stacked);
      ws.support_weights.resize(stacked);
    }
  } else {
    ws.live_block.assign(blocks, 0);
  }
  for (int64_t i = 0; i < stacked; ++i) {
    const int64_t g = i / rows, h = h0 + g, r = r0 + i % rows;
    // Per-head parameters; entmax with α = 1 is softmax.
    const float p0 = a.norm->num_params > 0 ? p.param[0][h] : 0.0f;
    const float p1 = a.norm->num_params > 1 ? p.param[1][h] : 0.0f;
    const bool entmax = a.norm->family == Family::kEntmax && p0 != 1.0f;
    any_entmax |= entmax;
    any_dense |= !entmax;
    const float slope = p.alibi ? p.alibi[h] : 0.0f;
    float* ent = p.entropy + head_rows(g) + i % rows;
    const int64_t pos = offset + r;
    const int64_t n = a.causal ? pos + 1 : p.lk;  // keys [0, n) may be visible
    const float lambda = p.query_scale ? p.query_scale[head_rows(g) + i % rows] : 1.0f;
    float* z = ws.logits.data() + i * stride;
    Row zr(z, n);  // keys [n, kend) are causally hidden
    if (slope != 0.0f) {
      zr = lambda * (p.scale * zr + slope * (Eigen::ArrayXf::LinSpaced(n, 0, n - 1) - float(pos)));
    } else {
      zr *= p.scale * lambda;
    }
    int64_t visible_keys = n;
    if (mask != nullptr && !p.mask_full[b]) {
      for (int64_t j = 0; j < n; ++j) {
        if (!mask[j]) {
          z[j] = kNegInf;
          --visible_keys;
        }
      }
    }
    if (paged)  // the pages not read carry no weight: exactly 0, as −inf logits give
      for (int64_t page = 0; page * kPage < n; ++page)
        if (ws.page_read[page] == 0) std::fill(z + page * kPage, z + std::min(n, page * kPage + kPage), kNegInf);
    float* h_out = ent;
    if (entmax) {  // weight only on the candidates (entmax_row): decode keeps them, a GEMM row gets them scattered
      int64_t m;
      ws.row_sum[i] = entmax_row(z, n, p0 - 1.0f, h_out, ws, &m);
      const float* w = ws.candidates.data();
      const int32_t* key = ws.cand_keys.data();
      if (skinny) {
        ws.sparse_row[i] = 1;
        std::vector<int32_t>& keys = ws.support_keys[i];
        AlignedFloats& weights = ws.support_weights[i];
        keys.clear();
        weights.clear();
        for (int64_t c = 0; c < m; ++c)
          if (w[c] != 0.0f) {
            keys.push_back(key[c]);
            weights.push_back(w[c]);
          }
      } else {
        if (m > 0) std::fill(z, z + kend, 0.0f);  // (a degenerate row was filled with its zeros or NaNs)
        else std::fill(z + n, z + kend, 0.0f);
        for (int64_t c = 0; c < m; ++c)
          if (w[c] != 0.0f) {
            z[key[c]] = w[c];
            ws.live_block[key[c] / kKeyBlock] = 1;
          }
      }
      continue;
    }
    transform_row(a.norm->transform, z, n, p0, p1, visible_keys);
    const float max = row_max(z, n);
    float lam, kp;
    if (degenerate_row(Row(z, kend), max, h_out, &lam)) {
      ws.row_sum[i] = lam;
      continue;
    }
    if (a.norm->transform == Transform::kEntropyBeta) {  // β from the plain softmax's entropy, then softmax(β t)
      float* plain = ws.shifted.data();
      lam = exp_pass(z, plain, n, max, 1.0f, &kp);
      const float beta = adaptive_beta(a, std::log(lam) - kp / lam);
      if (beta == 1.0f) {
        std::copy(plain, plain + n, z);
      } else {
        lam = exp_pass(z, z, n, max, beta, &kp);
      }
    } else {
      lam = exp_pass(z, z, n, max, 1.0f, &kp);
    }
    *h_out = std::log(lam) - kp / lam;
    ws.row_sum[i] = lam;
    std::fill(z + n, z + kend, 0.0f);
  }

  // O = W V / Z, into the stack, then each head's rows. Decode: a block of values at a time for the rows weighted
  // over every key, and for an entmax row the values of its support only. A GEMM tile: over the key blocks that
  // carry weight (all of them when a row is not entmax's).
  Matrix o(ws.stack.data(), stacked, p.dv);
  if (skinny) {
    o.setZero();
    if (any_dense) {
      for (int64_t j0 = 0; j0 < kend; j0 += kKeysPerPass) {
        const int64_t len = std::min(kKeysPerPass, kend - j0);
        const ConstMatrix vb = values(j0, len, ws.kv_block);
        for (int64_t i = 0; i < stacked; ++i)
          if (!ws.sparse_row[i]) o.row(i).noalias() += s.row(i).segment(j0, len) * vb;
      }
    }
    for (int64_t i = 0; i < stacked; ++i) {
      if (!ws.sparse_row[i]) continue;
      const std::vector<int32_t>& keys = ws.support_keys[i];
      const float* w = ws.support_weights[i].data();
      for (size_t c = 0; c < keys.size(); ++c) o.row(i).noalias() += w[c] * values(keys[c], 1, ws.kv_block).row(0);
    }
  } else if (!any_entmax && p.v16 == nullptr) {
    o.noalias() = s * values(0, kend, ws.kv_block);
  } else if (!any_entmax) {  // an fp16 cache: as for the logits, a block of widened values per GEMM
    o.setZero();
    for (int64_t j0 = 0; j0 < kend; j0 += kKeysPerPass) {
      const int64_t len = std::min(kKeysPerPass, kend - j0);
      o.noalias() += s.middleCols(j0, len) * values(j0, len, ws.kv_block);
    }
  } else {
    o.setZero();
    if (any_dense) std::fill(ws.live_block.begin(), ws.live_block.end(), 1);
    for (int64_t blk = 0; blk < blocks;) {  // one GEMM per run of live blocks
      if (!ws.live_block[blk]) {
        ++blk;
        continue;
      }
      int64_t end = blk;
      while (end < blocks && ws.live_block[end]) ++end;
      const int64_t j0 = blk * kKeyBlock, j1 = std::min(kend, end * kKeyBlock);
      o.noalias() += s.middleCols(j0, j1 - j0) * values(j0, j1 - j0, ws.kv_block);  // (fp16: only these widened)
      blk = end;
    }
  }
  for (int64_t i = 0; i < stacked; ++i) {
    const double z = ws.row_sum[i];
    Eigen::Map<Eigen::RowVectorXf> dst(p.out + (head_rows(i / rows) + i % rows) * p.dv, p.dv);
    if (z > 0) {
      dst = o.row(i) * static_cast<float>(1.0 / z);
    } else if (z == 0) {
      dst.setZero();
    } else {
      dst.setConstant(std::numeric_limits<float>::quiet_NaN());
    }
  }
}

// The cache form's write: `rows` (batch × KV head) rows of `s` keys in `past` become rows of `stride` keys in
// `present` with this step's `lq` keys at [w, w + lq). When the runtime gave present the past's own buffer (I/O
// binding, onnxruntime-genai's shared past/present) only those keys are written: nothing is read or copied.
// An fp16 cache takes the keys rounded to fp16 (the fp32 ones of this step are what its own rows attend with).
template <typename C>
void write_cache(C* present, const C* past, const float* fresh, int64_t rows, int64_t s, int64_t w, int64_t lq,
                 int64_t stride, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    C* dst = present + r * stride * d;
    const C* src = past + r * s * d;
    if (dst != src) std::copy(src, src + s * d, dst);
    store(fresh + r * lq * d, dst + w * d, lq * d);
  }
}

// The key summary's pages [from, to) of `rows` (batch × KV head) rows, recomputed from the cache's stored keys
// [0, lk): per page and dimension the minimum (row 0) and maximum (row 1) of its keys.
template <typename C>
void summarise(float* summary, const C* keys, int64_t rows, int64_t pages, int64_t stride, int64_t from, int64_t to,
               int64_t lk, int64_t d) {
  AlignedFloats wide(static_cast<size_t>(d));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t page = from; page < to; ++page) {
      float* kmin = summary + (r * pages + page) * 2 * d;
      float* kmax = kmin + d;
      std::fill(kmin, kmin + d, std::numeric_limits<float>::infinity());
      std::fill(kmax, kmax + d, -std::numeric_limits<float>::infinity());
      for (int64_t j = page * kPage; j < std::min(lk, page * kPage + kPage); ++j) {
        const float* key;
        if constexpr (std::is_same_v<C, Half>) {
          widen(keys + (r * stride + j) * d, wide.data(), d);
          key = wide.data();
        } else {
          key = keys + (r * stride + j) * d;
        }
        for (int64_t x = 0; x < d; ++x) {
          kmin[x] = std::min(kmin[x], key[x]);
          kmax[x] = std::max(kmax[x], key[x]);
        }
      }
    }
}

void run_task(void* problem, size_t task) { run_tile(*static_cast<const Problem*>(problem), static_cast<int64_t>(task)); }

// ---- decode split over the keys ----------------------------------------------------------------------------
// A decode step has one task per (batch, KV head): SmolLM2's 3 KV heads on 2 threads leave one idle for a third
// of the step, 8 KV heads on 16 threads half of them. For rows whose normaliser is local to each key once the
// row's max is known (the softmax family but the adaptive β, which needs the whole row's entropy first), the keys
// split into 512-key chunks, one task each, as flash-decoding does on GPUs: a chunk's rows keep their max m, their
// sums Λ = Σ e^{z−m} and K' = Σ e^{z−m}(z − m), and Σ e^{z−m} v; the step then rescales each chunk by e^{m − M} to
// the row's max M. The chunks are fixed by the keys, not the threads, so results still do not depend on them.
struct ChunkSums {
  float m, lam, kp;
};

struct Split {
  const Problem* p;
  int64_t chunks, kend;
  const int64_t* visible;  // per (batch, query row): its visible keys (SSMax's n), when the norm reads it
  ChunkSums* sums;         // (batch·KV heads, chunks, stacked rows)
  float* acc;              // (batch·KV heads, chunks, stacked rows, Dv)
};

bool splits_keys(const Attributes& a, int64_t tiles, int64_t stacked, int64_t kend) {
  return a.norm->family == Family::kSoftmax && a.norm->transform != Transform::kEntropyBeta && tiles == 1 &&
         stacked <= kSkinnyRows && kend > kKeysPerPass;
}

// One chunk of keys for every stacked row of a (batch, KV head): logits, transform, max, exp pass, Σ e^{z−m} v.
void run_chunk(const Split& sp, int64_t task) {
  const Problem& p = *sp.p;
  const Attributes& a = *p.a;
  const int64_t c = task % sp.chunks, bk = task / sp.chunks, kvh = bk % p.hkv, b = bk / p.hkv;
  const int64_t group = p.hq / p.hkv, stacked = group * p.lq, offset = p.lk - p.lq;
  const int64_t j0 = c * kKeysPerPass, len = std::min(kKeysPerPass, sp.kend - j0);
  Workspace& ws = tls_workspace;
  const int64_t stride = (len + kAlign - 1) / kAlign * kAlign;
  ws.logits.resize(static_cast<size_t>(stacked * stride));
  const int64_t first = (b * p.hkv + kvh) * p.kstride + j0;
  const auto rows_of = [&](const float* f32, const Half* f16, int64_t dim, AlignedFloats& buf) -> const float* {
    if (f16 == nullptr) return f32 + first * dim;
    buf.resize(static_cast<size_t>(len * dim));
    widen(f16 + first * dim, buf.data(), len * dim);
    return buf.data();
  };
  const ConstMatrix kb(rows_of(p.k, p.k16, p.d, ws.kv_block), len, p.d);
  const bool* mask = p.key_mask && !p.mask_full[b] ? p.key_mask + b * p.lk + j0 : nullptr;
  ChunkSums* sums = sp.sums + (bk * sp.chunks + c) * stacked;
  float* acc = sp.acc + (bk * sp.chunks + c) * stacked * p.dv;
  std::fill(acc, acc + stacked * p.dv, 0.0f);
  int64_t widest = 0;  // the most keys a row with weight sees here: the values read, once for all rows
  for (int64_t i = 0; i < stacked; ++i) {
    float* z = ws.logits.data() + i * stride;
    const int64_t h = kvh * group + i / p.lq, r = i % p.lq, row = (b * p.hq + h) * p.lq + r;
    const int64_t pos = offset + r, n = a.causal ? pos + 1 : p.lk;
    const int64_t seen = std::min(len, n - j0);  // this chunk's keys the row may see
    sums[i] = {kNegInf, 0.0f, 0.0f};
    if (seen <= 0) continue;
    Eigen::Map<Eigen::RowVectorXf> zr(z, seen);
    zr.noalias() = Eigen::Map<const Eigen::RowVectorXf>(p.q + row * p.d, p.d) * kb.topRows(seen).transpose();
    const float lambda = p.query_scale ? p.query_scale[row] : 1.0f, slope = p.alibi ? p.alibi[h] : 0.0f;
    if (slope != 0.0f) {
      zr.array() = lambda * (p.scale * zr.array() +
                             slope * (Eigen::ArrayXf::LinSpaced(seen, float(j0), float(j0 + seen - 1)) - float(pos)).transpose());
    } else {
      zr *= p.scale * lambda;
    }
    if (mask != nullptr)
      for (int64_t j = 0; j < seen; ++j)
        if (!mask[j]) z[j] = kNegInf;
    const float p0 = a.norm->num_params > 0 ? p.param[0][h] : 0.0f;
    const float p1 = a.norm->num_params > 1 ? p.param[1][h] : 0.0f;
    transform_row(a.norm->transform, z, seen, p0, p1, sp.visible ? sp.visible[b * p.lq + r] : 0);
    const float m = row_max(z, seen);
    sums[i].m = m;
    if (!std::isfinite(m)) continue;  // nothing visible here (−inf), or a degenerate row (the step tells)
    float kp;
    sums[i].lam = exp_pass(z, z, seen, m, 1.0f, &kp);
    sums[i].kp = kp;
    widest = std::max(widest, seen);
  }
  if (widest == 0) return;
  const ConstMatrix vb(rows_of(p.v, p.v16, p.dv, ws.kv_block), widest, p.dv);  // (an fp16 cache: K is done)
  for (int64_t i = 0; i < stacked; ++i) {
    if (!std::isfinite(sums[i].m)) continue;
    const int64_t pos = offset + i % p.lq, n = a.causal ? pos + 1 : p.lk;
    const int64_t seen = std::min(len, n - j0);
    Eigen::Map<Eigen::RowVectorXf>(acc + i * p.dv, p.dv).noalias() =
        Eigen::Map<const Eigen::RowVectorXf>(ws.logits.data() + i * stride, seen) * vb.topRows(seen);
  }
}

void run_chunk_task(void* split, size_t task) { run_chunk(*static_cast<const Split*>(split), static_cast<int64_t>(task)); }

// The step's rows from their chunks: M = the largest chunk max, Λ = Σ e^{m−M} Λ_c, K' = Σ e^{m−M} (K'_c + (m − M) Λ_c),
// O = Σ e^{m−M} (Σ e^{z−m} v)_c / Λ and entropy log Λ − K'/Λ. A NaN or +inf max in any chunk makes the row NaN and
// a row that sees nothing gives zeros, as a whole row does (degenerate_row).
void combine_chunks(const Split& sp) {
  const Problem& p = *sp.p;
  const int64_t group = p.hq / p.hkv, stacked = group * p.lq;
  Eigen::RowVectorXd o(p.dv);
  AlignedFloats shift(static_cast<size_t>(sp.chunks)), scale(static_cast<size_t>(sp.chunks));  // m − M, e^{m − M}
  for (int64_t bk = 0; bk < p.batch * p.hkv; ++bk) {
    const int64_t b = bk / p.hkv, kvh = bk % p.hkv;
    for (int64_t i = 0; i < stacked; ++i) {
      const int64_t row = (b * p.hq + kvh * group + i / p.lq) * p.lq + i % p.lq;
      float* out = p.out + row * p.dv;
      float top = kNegInf;
      for (int64_t c = 0; c < sp.chunks; ++c) {
        const float m = sp.sums[(bk * sp.chunks + c) * stacked + i].m;
        top = std::isnan(m) || std::isnan(top) ? kNaN : std::max(top, m);
      }
      if (!std::isfinite(top)) {
        const float fill = top == kNegInf ? 0.0f : kNaN;
        std::fill(out, out + p.dv, fill);
        p.entropy[row] = fill;
        continue;
      }
      for (int64_t c = 0; c < sp.chunks; ++c) shift[c] = sp.sums[(bk * sp.chunks + c) * stacked + i].m - top;
      map_row(shift.data(), scale.data(), sp.chunks, [](Packet x) { return ei::pexp(x); });  // −inf → 0
      double lam = 0.0, kp = 0.0;
      o.setZero();
      for (int64_t c = 0; c < sp.chunks; ++c) {
        const ChunkSums& s = sp.sums[(bk * sp.chunks + c) * stacked + i];
        if (s.m == kNegInf) continue;
        const double w = scale[c];
        lam += w * s.lam;
        kp += w * (s.kp + static_cast<double>(shift[c]) * s.lam);
        o += w * Eigen::Map<const Eigen::RowVectorXf>(sp.acc + ((bk * sp.chunks + c) * stacked + i) * p.dv, p.dv).cast<double>();
      }
      p.entropy[row] = static_cast<float>(std::log(lam) - kp / lam);
      Eigen::Map<Eigen::RowVectorXf>(out, p.dv) = (o / lam).cast<float>();
    }
  }
}

// ---- the kernel ----------------------------------------------------------------------------------------------

struct Kernel {
  Attributes a;
  explicit Kernel(const OrtKernelInfo* info) : a(read_attributes(info)) {}

  void Compute(OrtKernelContext* ctx) const {
    const OrtApi& api = Ort::GetApi();
    size_t count = 0;
    check(api.KernelContext_GetInputCount(ctx, &count));
    Tensor t[kNumSlots];
    for (int s = 0; s < kNumSlots; ++s) t[s] = input(ctx, count, s);
    for (int s : {kQ, kK, kV})
      if (t[s].shape.size() != 4 || !t[s].present())
        invalid(std::string("input ") + kSlotNames[s] + " must have rank 4, got shape " + shape_string(t[s].shape));
    const int64_t batch = t[kQ].shape[0], hq = t[kQ].shape[1], lq = t[kQ].shape[2], d = t[kQ].shape[3];
    const int64_t hkv = t[kK].shape[1], dv = t[kV].shape[3];
    int64_t lk = t[kK].shape[2];
    if (hq != a.q_heads) invalid("Q has " + std::to_string(hq) + " heads, the node says q_heads " + std::to_string(a.q_heads));
    if (hkv != a.kv_heads)
      invalid("K has " + std::to_string(hkv) + " heads, the node says kv_heads " + std::to_string(a.kv_heads));
    expect_shape(t[kK], kK, {batch, hkv, lk, d});
    expect_shape(t[kV], kV, {batch, hkv, lk, dv});
    const float *keys = t[kK].f(), *values = t[kV].f();
    const Half *keys16 = nullptr, *values16 = nullptr;  // an fp16 cache's (then keys and values are null)
    int64_t kstride = lk;
    std::vector<float> scratch[2];  // the cache form's keys and values when no present output is asked for
    std::vector<Half> scratch16[2];
    const float* summary = nullptr;  // the cache's key summary, when the node has one
    int64_t summary_pages = 0;
    std::vector<float> summary_scratch;
    const bool cache_form = t[kPastKey].present() || t[kPastValue].present() || t[kPastLength].present();
    if (cache_form) {  // K, V: this step's keys; written into the cache at [W, W + Lq), attention over [0, W + Lq)
      if (!t[kPastKey].present() || !t[kPastValue].present() || !t[kPastLength].present())
        invalid("the cache form needs past_key, past_value and past_length together");
      if (lk != lq) invalid("in the cache form K holds this step's " + std::to_string(lq) + " keys, got " + std::to_string(lk));
      const Tensor& pl = t[kPastLength];
      if (pl.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 || (pl.shape.size() > 1) || (pl.shape.size() == 1 && pl.shape[0] != 1))
        invalid("input past_length must be one int64 (shape () or (1,)), got shape " + shape_string(pl.shape));
      const int64_t w = *static_cast<const int64_t*>(pl.data);
      const Tensor &pk = t[kPastKey], &pv = t[kPastValue];
      if (pk.shape.size() != 4) invalid("input past_key must have rank 4, got shape " + shape_string(pk.shape));
      const int64_t s = pk.shape[2];
      expect_shape(pk, kPastKey, {batch, hkv, s, d});
      expect_shape(pv, kPastValue, {batch, hkv, s, dv});
      const bool half = pk.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
      for (int slot : {kPastKey, kPastValue})
        if (t[slot].type != (half ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT))
          invalid("inputs past_key and past_value must both be float32 or both float16");
      if (w < 0 || w > s)
        invalid("past_length " + std::to_string(w) + " must be in [0, " + std::to_string(s) + "] (past_key's keys)");
      kstride = std::max(s, w + lq);
      lk = w + lq;
      void* present[2];
      const int64_t present_shape[2][4] = {{batch, hkv, kstride, d}, {batch, hkv, kstride, dv}};
      size_t outputs = 0;
      check(api.KernelContext_GetOutputCount(ctx, &outputs));
      for (int i = 0; i < 2; ++i) {
        OrtValue* value = nullptr;
        if (outputs > static_cast<size_t>(kPresentKey + i))
          check(api.KernelContext_GetOutput(ctx, kPresentKey + i, present_shape[i], 4, &value));
        const size_t n = static_cast<size_t>(batch * hkv * kstride * (i ? dv : d));
        if (value != nullptr) {
          check(api.GetTensorMutableData(value, &present[i]));
        } else if (half) {  // no present asked for: a scratch copy still holds the keys attention reads
          scratch16[i].resize(n);
          present[i] = scratch16[i].data();
        } else {
          scratch[i].resize(n);
          present[i] = scratch[i].data();
        }
      }
      if (half) {
        write_cache(static_cast<Half*>(present[0]), static_cast<const Half*>(pk.data), keys, batch * hkv, s, w, lq, kstride, d);
        write_cache(static_cast<Half*>(present[1]), static_cast<const Half*>(pv.data), values, batch * hkv, s, w, lq, kstride, dv);
        keys16 = static_cast<const Half*>(present[0]), values16 = static_cast<const Half*>(present[1]);
        keys = values = nullptr;
      } else {
        write_cache(static_cast<float*>(present[0]), pk.f(), keys, batch * hkv, s, w, lq, kstride, d);
        write_cache(static_cast<float*>(present[1]), pv.f(), values, batch * hkv, s, w, lq, kstride, dv);
        keys = static_cast<const float*>(present[0]), values = static_cast<const float*>(present[1]);
      }
      if (t[kPastKeySummary].present() || t[kSummaryLength].present())
        summary = key_summary(ctx, t, batch, hkv, s, w, lq, kstride, d, keys, keys16, &summary_pages, summary_scratch);
    } else if (t[kPastKeySummary].present() || t[kSummaryLength].present()) {
      invalid("past_key_summary and summary_length need the cache form (past_key, past_value, past_length)");
    }
    if (lq > lk) invalid("Q has " + std::to_string(lq) + " rows but K only " + std::to_string(lk) + " keys (Lq <= Lk)");
    if (t[kKeyMask].present()) expect_shape(t[kKeyMask], kKeyMask, {batch, lk});
    if (t[kAlibi].present()) expect_shape(t[kAlibi], kAlibi, {hq});
    if (a.norm->query_scale) {
      if (!t[kQueryScale].present()) invalid(std::string("norm '") + a.norm->name + "' needs input query_scale");
      expect_shape(t[kQueryScale], kQueryScale, {batch, hq, lq});
    }
    for (int s : {kQ, kK, kV, kAlibi, kAlpha, kQueryScale, kSsaN, kSsaB, kSsmaxS})
      if (t[s].present() && t[s].type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
        invalid(std::string("input ") + kSlotNames[s] + " must be float32");
    if (t[kKeyMask].present() && t[kKeyMask].type != ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL)
      invalid("input key_mask must be bool");
    Problem p{};
    p.a = &a;
    for (int i = 0; i < a.norm->num_params; ++i) {
      const Tensor& param = t[a.param_slot[i]];
      if (!param.present()) invalid(std::string("norm '") + a.norm->name + "' needs input " + a.norm->params[i]);
      expect_shape(param, a.param_slot[i], {hq});
      p.param[i] = param.f();
    }
    p.q = t[kQ].f(), p.k = keys, p.v = values, p.k16 = keys16, p.v16 = values16, p.kstride = kstride;
    p.summary = summary, p.summary_pages = summary_pages;
    p.alibi = t[kAlibi].present() ? t[kAlibi].f() : nullptr;
    // λ is read only by norms that take it (the registry's query_scale flag), as the fallback bodies do.
    p.query_scale = a.norm->query_scale ? t[kQueryScale].f() : nullptr;
    p.key_mask = t[kKeyMask].present() ? static_cast<const bool*>(t[kKeyMask].data) : nullptr;
    std::vector<char> mask_full(batch, 1);
    if (p.key_mask != nullptr)
      for (int64_t bi = 0; bi < batch; ++bi) mask_full[bi] = std::all_of(p.key_mask + bi * lk, p.key_mask + (bi + 1) * lk, [](bool x) { return x; });
    p.mask_full = mask_full.data();
    p.batch = batch, p.hq = hq, p.hkv = hkv, p.lq = lq, p.lk = lk, p.d = d, p.dv = dv;
    p.scale = std::isnan(a.scale) ? 1.0f / std::sqrt(static_cast<float>(d)) : a.scale;
    p.tile_rows = std::max<int64_t>(1, kQueryTile / (hq / hkv));  // a GQA group's stacked rows: about kQueryTile
    p.tiles = (lq + p.tile_rows - 1) / p.tile_rows;

    const int64_t out_shape[4] = {batch, hq, lq, dv};
    OrtValue* o = nullptr;
    check(api.KernelContext_GetOutput(ctx, 0, out_shape, 4, &o));
    check(api.GetTensorMutableData(o, reinterpret_cast<void**>(&p.out)));
    size_t outputs = 0;
    check(api.KernelContext_GetOutputCount(ctx, &outputs));
    std::vector<float> discard;
    if (outputs > 1) {
      OrtValue* e = nullptr;
      check(api.KernelContext_GetOutput(ctx, 1, out_shape, 3, &e));
      if (e != nullptr) check(api.GetTensorMutableData(e, reinterpret_cast<void**>(&p.entropy)));
    }
    if (p.entropy == nullptr) {
      discard.resize(static_cast<size_t>(batch * hq * lq));
      p.entropy = discard.data();
    }
    if (batch > 0 && splits_keys(a, p.tiles, (hq / hkv) * lq, lk)) {  // decode: a task per chunk of keys (one tile: kend = Lk)
      thread_local std::vector<ChunkSums> sums;
      thread_local AlignedFloats acc;
      thread_local std::vector<int64_t> visible;
      Split sp{&p, (lk + kKeysPerPass - 1) / kKeysPerPass, lk, nullptr, nullptr, nullptr};
      const size_t rows = static_cast<size_t>(batch * hkv * sp.chunks * (hq / hkv) * lq);
      sums.resize(rows);
      acc.resize(rows * static_cast<size_t>(dv));
      if (a.norm->transform == Transform::kLogNScale) {  // each row's visible keys, as the whole-row path counts them
        visible.assign(static_cast<size_t>(batch * lq), 0);
        for (int64_t bi = 0; bi < batch; ++bi)
          for (int64_t r = 0; r < lq; ++r) {
            const int64_t n = a.causal ? lk - lq + r + 1 : lk;
            visible[bi * lq + r] = p.key_mask == nullptr || p.mask_full[bi] ? n : std::count(p.key_mask + bi * lk, p.key_mask + bi * lk + n, true);
          }
        sp.visible = visible.data();
      }
      sp.sums = sums.data();
      sp.acc = acc.data();
      check(api.KernelContext_ParallelFor(ctx, run_chunk_task, static_cast<size_t>(batch * hkv * sp.chunks), 0, &sp));
      combine_chunks(sp);
      return;
    }
    const size_t tasks = static_cast<size_t>(batch * hkv * p.tiles);
    if (tasks == 0) return;
    if (tasks == 1) {
      run_task(&p, 0);
    } else {
      check(api.KernelContext_ParallelFor(ctx, run_task, tasks, 0, &p));
    }
  }

  // The cache form's key summary (docs/op.md): present_key_summary holds past_key_summary's pages with those from
  // summary_length's on recomputed from the present keys [0, w + lq) (written in place when the runtime gave it the
  // past's buffer). Returns it, with its pages per (batch, KV head) row in *pages_out.
  static const float* key_summary(OrtKernelContext* ctx, const Tensor* t, int64_t batch, int64_t hkv, int64_t s,
                                  int64_t w, int64_t lq, int64_t kstride, int64_t d, const float* keys,
                                  const Half* keys16, int64_t* pages_out, std::vector<float>& scratch) {
    const OrtApi& api = Ort::GetApi();
    const Tensor &past = t[kPastKeySummary], &length = t[kSummaryLength];
    if (!past.present() || !length.present())
      invalid("the key summary needs past_key_summary and summary_length together");
    const int64_t pages_in = (s + kPage - 1) / kPage, pages = (kstride + kPage - 1) / kPage;
    if (past.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) invalid("input past_key_summary must be float32");
    expect_shape(past, kPastKeySummary, {batch, hkv, pages_in, 2, d});
    if (length.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 || length.shape.size() > 1 ||
        (length.shape.size() == 1 && length.shape[0] != 1))
      invalid("input summary_length must be one int64 (shape () or (1,)), got shape " + shape_string(length.shape));
    const int64_t covered = *static_cast<const int64_t*>(length.data);
    if (covered < 0 || covered > w)
      invalid("summary_length " + std::to_string(covered) + " must be in [0, " + std::to_string(w) + "] (past_length)");
    const int64_t shape[5] = {batch, hkv, pages, 2, d};
    size_t outputs = 0;
    check(api.KernelContext_GetOutputCount(ctx, &outputs));
    OrtValue* value = nullptr;
    if (outputs > static_cast<size_t>(kPresentKeySummary))
      check(api.KernelContext_GetOutput(ctx, kPresentKeySummary, shape, 5, &value));
    float* out = nullptr;
    if (value != nullptr) {
      check(api.GetTensorMutableData(value, reinterpret_cast<void**>(&out)));
    } else {
      scratch.resize(static_cast<size_t>(batch * hkv * pages * 2 * d));
      out = scratch.data();
    }
    const int64_t rows = batch * hkv, end = w + lq, from = covered / kPage, to = (end + kPage - 1) / kPage;
    if (out != past.f())  // pages before `from` are the past's; the rest are recomputed
      for (int64_t r = 0; r < rows; ++r)
        std::copy(past.f() + r * pages_in * 2 * d, past.f() + (r * pages_in + from) * 2 * d, out + r * pages * 2 * d);
    if (keys16 != nullptr) {
      summarise(out, keys16, rows, pages, kstride, from, to, end, d);
    } else {
      summarise(out, keys, rows, pages, kstride, from, to, end, d);
    }
    *pages_out = pages;
    return out;
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) const {
    return as_status("SharpAttention", [&] { Compute(ctx); });
  }
};

struct Op : Ort::CustomOpBase<Op, Kernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    try {
      *kernel = new Kernel(info);
      return nullptr;
    } catch (const Error& e) {
      return api.CreateStatus(e.code, e.what());
    } catch (const std::exception& e) {
      return api.CreateStatus(ORT_FAIL, e.what());
    }
  }
  const char* GetName() const { return "SharpAttention"; }
  size_t GetInputTypeCount() const { return kNumSlots; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == kKeyMask) return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
    if (i == kPastKey || i == kPastValue) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // float or float16
    return i == kPastLength || i == kSummaryLength ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i <= kV ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return kNumOutputs; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {  // presents: the pasts' type
    return i == kPresentKey || i == kPresentValue ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
};

#include "block_offsets.h"

}  // namespace sharp

// The instruction set this library was compiled for, readable from the file without loading it (a library built
// for a wider ISA than the CPU's must never be loaded: its first vector instruction would kill the process).
#ifndef SHARP_ISA
#define SHARP_ISA "unknown"
#endif
extern "C" __attribute__((used, visibility("default"))) const char kSharpIsa[] = "SHARP_ISA=" SHARP_ISA;

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // an ORT older than these headers: cannot even report an error
  Ort::InitApi(api);
  static sharp::Op op;
  static sharp::OffsetsOp offsets;
  static std::once_flag once;
  static OrtCustomOpDomain* domain = nullptr;
  static OrtStatus* failed = nullptr;
  std::call_once(once, [&] {
    failed = api->CreateCustomOpDomain("sharp", &domain);
    if (failed == nullptr) failed = api->CustomOpDomain_Add(domain, &op);
    if (failed == nullptr) failed = api->CustomOpDomain_Add(domain, &offsets);
  });
  if (failed != nullptr) return api->CreateStatus(api->GetErrorCode(failed), api->GetErrorMessage(failed));
  return api->AddCustomOpDomain(options, domain);
}
