// Simd for the scalar tier (no AVX2): one 4-byte lane, the same algorithm in plain C++.
// Included by qlinear_simd.h only (the vocabulary is explained there).
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace fitserve::qlinear {

struct Simd {
  static constexpr int kBytes = 4;
  static constexpr int kLanes = 1;
  static constexpr int kFloatBytes = 1;
  static constexpr int kPanelMT = 4;
  static constexpr uint8_t kAct8Xor = 0x00;
  struct B { uint8_t v[4]; };
  using I = int32_t;
  using F = float;

  static B load_bytes(const void* p, int n) {
    B b{};
    std::memcpy(b.v, p, n >= kBytes ? kBytes : n);
    return b;
  }
  static B nib_lo(B w) {
    for (auto& v : w.v) v &= 0x0F;
    return w;
  }
  static B nib_hi(B w) {
    for (auto& v : w.v) v >>= 4;
    return w;
  }
  static I izero() { return 0; }
  static I dot_u4(I acc, B u, B s) {
    for (int i = 0; i < 4; ++i) acc += int32_t(u.v[i]) * int32_t(int8_t(s.v[i]));
    return acc;
  }
  using W8 = B;
  static W8 prep_w8(B w) { return w; }
  static I dot_w8(const W8& w, B a) {
    int32_t acc = 0;
    for (int i = 0; i < 4; ++i) acc += int32_t(int8_t(w.v[i])) * int32_t(int8_t(a.v[i]));
    return acc;
  }
  static F cvt(I v) { return static_cast<float>(v); }
  static F fzero() { return 0.f; }
  static F set1(float v) { return v; }
  static F mul(F a, F b) { return a * b; }
  static F add(F a, F b) { return a + b; }
  // no FMA instructions in this tier: a * b is rounded on its own
  static F mulr(F a, F b) { return a * b; }
  static F fmadd(F a, F b, F c) { return std::fma(a, b, c); }
  static F loadf(const float* p) { return *p; }
  static void storef(float* p, F v) { *p = v; }
  static F loadf(const float* p, int n) { return n > 0 ? *p : 0.f; }
  using HMask = int;
  static HMask hmask(int n) { return n; }
  static F load_half(const at::Half* p, int n) { return n > 0 ? static_cast<float>(*p) : 0.f; }
  using P = int32_t;
  static P load_perm(const int32_t*) { return 0; }
  static F permute(F v, P) { return v; }
  static float h2f(at::Half h) { return static_cast<float>(h); }
  static float hsum(F v) { return v; }
  static void nib_f(const uint8_t* p, F& lo, F& hi) {
    lo = static_cast<float>(*p & 0x0F);
    hi = static_cast<float>(*p >> 4);
  }
  static F i8_f(const int8_t* p) { return static_cast<float>(*p); }

  // ---- panel kernels (qlinear_panel.h): one lane = one weight row
  static B loadb(const void* p) { return load_bytes(p, kBytes); }
  static B bcast4(const int8_t* p) { return load_bytes(p, kBytes); }
  static I iset1(int32_t v) { return v; }
  static I iadd(I a, I b) { return a + b; }
  static constexpr bool kW8Biased = false;
  static I dot_w8p(I acc, B w, B a) { return acc + dot_w8(w, a); }
  static void storef(float* p, F v, int n) {
    if (n > 0) *p = v;
  }
  static void transpose_dwords(const uint8_t* const* rows, int64_t off, uint32_t* out) {
    std::memcpy(out, rows[0] + off, 4);
  }

  static void quant32(const float* x, int8_t* q, float& da, int32_t& isum) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) {
      // NOTE: round half to even (nearbyint in the default rounding mode, like vcvtps2dq)
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x[i] * id)));
      q[i] = static_cast<int8_t>(v);
      s += static_cast<int32_t>(v);
    }
    isum = s;
    float probe = 0.f;  // NaN / inf in x -> NaN block scale (it must not vanish in the rounding)
    for (int i = 0; i < 32; ++i) probe += x[i] * 0.f;
    da = amax / 127.f + probe;
  }
};

}  // namespace fitserve::qlinear
