// The M > 1 weight layout chosen once at load: a weight's full panels of kLanes rows in the
// PanelView layout of qlinear_panel.h, so the panel kernels read them as they are instead of
// transposing kLanes rows per panel on every call.
//
//   blob = panel 0 | panel 1 | ... | panel P-1 | unused tail      P = N / kLanes (full panels)
//   panel = wq [row_bytes / 4][kLanes] u32 | dv [G][kLanes] f32 | cv [G][kLanes] f32 (int4)
//
// The blob is sized N * panel_row_bytes (codes + 4 (int8) or 8 (int4) bytes per group and row),
// what the ledger counts beside the packed weight (fitserve/ledger/weights.py panel_bytes). The
// last N % kLanes rows are packed per call from qweight, as before. The layout depends on the ISA tier (kLanes; VNNI int8 codes stored ^ 0x80), so a
// blob is only ever made and read by the same loaded extension.
//
// Registry: the ops keep their signatures (the decode step calls them with qweight), so a
// prepacked weight is found by its qweight: qlinear_prepack registers (qweight, scales, mins)
// -> blob with weak references and version counters; a lookup that finds any of them freed,
// replaced or modified in place (load_state_dict) drops the entry and the call packs as before.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <mutex>
#include <optional>
#include <unordered_map>

#include "qlinear_panel.h"

namespace fitserve::qlinear {

// The view of full panel `pi` (rows pi * kLanes ..) inside a blob.
inline PanelView prepacked_panel(const uint8_t* blob, const QWeight& w, bool int4, int64_t pi) {
  const uint8_t* p = blob + pi * S::kLanes * panel_row_bytes(w, int4);
  const auto* dv = reinterpret_cast<const float*>(p + S::kLanes * w.row_bytes);
  return {reinterpret_cast<const uint32_t*>(p), dv, int4 ? dv + w.ngroups * S::kLanes : nullptr};
}

// Fills blob (N * panel_row_bytes bytes) with the full panels of w.
inline void prepack_panels(const QWeight& w, bool int4, uint8_t* blob) {
  const int64_t full = w.N / S::kLanes;
  at::parallel_for(0, full, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t pi = p0; pi < p1; ++pi) {
      const PanelView v = prepacked_panel(blob, w, int4, pi);
      pack_panel(w, int4, pi * S::kLanes, nullptr, const_cast<uint32_t*>(v.wq),
                 const_cast<float*>(v.dv), const_cast<float*>(v.cv));
    }
  });
}

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// One registered tensor: the same TensorImpl, data and (where tracked) version as at packing.
struct Pinned {
  std::optional<WeakImpl> impl;  // none: no tensor (symmetric weights have no mins)
  const void* data = nullptr;
  int64_t version = -1;  // -1: inference tensor (no version counter)

  static Pinned of(const at::Tensor* t) {
    if (t == nullptr || !t->defined()) return {};
    return {WeakImpl(t->getIntrusivePtr()), t->data_ptr(),
            t->is_inference() ? -1 : static_cast<int64_t>(t->_version())};
  }
  bool expired() const { return impl && impl->expired(); }
  bool same(const at::Tensor* t) const {
    if (t == nullptr || !t->defined()) return !impl;
    if (!impl) return false;
    auto live = impl->lock();
    return live.get() == t->unsafeGetTensorImpl() && t->data_ptr() == data &&
           (version < 0 || static_cast<int64_t>(t->_version()) == version);
  }
};

struct PrepackEntry {
  Pinned q, scales, mins;
  WeakImpl blob;
  int64_t group;
  bool int4;
};

class PrepackRegistry {
 public:
  static PrepackRegistry& get() {
    static PrepackRegistry r;
    return r;
  }
  void add(const at::Tensor& q, const at::Tensor& scales, const at::Tensor* mins, int64_t group,
           bool int4, const at::Tensor& blob) {
    std::lock_guard<std::mutex> lock(mu_);
    prune();
    map_.insert_or_assign(q.unsafeGetTensorImpl(),
                          PrepackEntry{Pinned::of(&q), Pinned::of(&scales), Pinned::of(mins),
                                       WeakImpl(blob.getIntrusivePtr()), group, int4});
  }
  // The blob made for exactly these tensors, or an undefined tensor.
  at::Tensor find(const at::Tensor& q, const at::Tensor& scales, const at::Tensor* mins,
                  int64_t group, bool int4) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = map_.find(q.unsafeGetTensorImpl());
    if (it == map_.end()) return {};
    const PrepackEntry& e = it->second;
    auto blob = e.blob.lock();
    if (!blob || !e.q.same(&q) || !e.scales.same(&scales) || !e.mins.same(mins) ||
        e.group != group || e.int4 != int4) {
      map_.erase(it);  // stale: freed, replaced or written in place
      return {};
    }
    return at::Tensor(std::move(blob));
  }
  void remove(const at::Tensor& q) {
    std::lock_guard<std::mutex> lock(mu_);
    map_.erase(q.unsafeGetTensorImpl());
  }

 private:
  void prune() {  // entries whose weight or blob is gone
    for (auto it = map_.begin(); it != map_.end();)
      it = it->second.blob.expired() || it->second.q.expired() ? map_.erase(it) : std::next(it);
  }
  std::mutex mu_;
  std::unordered_map<const c10::TensorImpl*, PrepackEntry> map_;
};

}  // namespace fitserve::qlinear
