/* SPDX-License-Identifier: MIT */
/*
 * gloo/common/memory.h for Debian's libgloo-dev (0.0~git20220518), which installs the tcp
 * transport's headers (gloo/transport/tcp/pair.h, context.h, unbound_buffer.h) but not this one,
 * which they include. gloo_comm.cc needs those headers to derive its MeshPair from tcp::Pair.
 *
 * The build adds this directory with -idirafter, so a Gloo that installs its own memory.h is
 * used instead. What must agree with the library is only what reaches the ABI: the three class
 * templates, in namespace gloo, under these names (they occur in mangled member names), each
 * holding exactly one standard smart pointer (their size is part of tcp::Pair's layout, which the
 * library's constructor fills in). libfsdp never calls them itself: every use is compiled inside
 * libgloo. The members below are what the tcp headers' inline functions use: construction of a
 * weak reference from the owning one, and a test for being set.
 */
#ifndef FSDP_GLOO_COMPAT_MEMORY_H
#define FSDP_GLOO_COMPAT_MEMORY_H

#include <memory>
#include <thread>

namespace gloo {

template <typename T> class WeakNonOwningPtr;

/* The owner's handle on an object it does not free: weak references come from it, and its
 * destructor waits until no strong reference made from one is left. */
template <typename T> class ShareableNonOwningPtr final {
  public:
    explicit ShareableNonOwningPtr(T *t) : ptr_(t, [](T *) {}) {}
    ShareableNonOwningPtr(const ShareableNonOwningPtr &) = delete;
    ShareableNonOwningPtr &operator=(const ShareableNonOwningPtr &) = delete;
    ~ShareableNonOwningPtr() {
        std::weak_ptr<T> left(ptr_);
        ptr_.reset();
        while (!left.expired())
            std::this_thread::yield();
    }

  private:
    std::shared_ptr<T> ptr_;
    friend class WeakNonOwningPtr<T>;
};

/* A strong reference for the duration of one use, made from a weak one. */
template <typename T> class NonOwningPtr final {
  public:
    NonOwningPtr() = default;
    explicit NonOwningPtr(const WeakNonOwningPtr<T> &w) : ptr_(w.ptr_.lock()) {}
    T *operator->() const noexcept {
        return ptr_.get();
    }
    explicit operator bool() const noexcept {
        return static_cast<bool>(ptr_);
    }

  private:
    std::shared_ptr<T> ptr_;
};

/* A weak reference to an object owned through a ShareableNonOwningPtr. */
template <typename T> class WeakNonOwningPtr final {
  public:
    WeakNonOwningPtr() = default;
    explicit WeakNonOwningPtr(const ShareableNonOwningPtr<T> &owner) : ptr_(owner.ptr_) {}
    /* Set: made from an owner, whether or not the object still lives. */
    explicit operator bool() const noexcept {
        std::weak_ptr<T> none;
        return ptr_.owner_before(none) || none.owner_before(ptr_);
    }

  private:
    std::weak_ptr<T> ptr_;
    friend class NonOwningPtr<T>;
};

} // namespace gloo

#endif /* FSDP_GLOO_COMPAT_MEMORY_H */
