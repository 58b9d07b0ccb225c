/* SPDX-License-Identifier: MIT */
/*
 * gloo_comm.cc: the Gloo transport of the gloo process group (the only C++ in libfsdp).
 *
 * One comm is one rank's Gloo state for one group: a tcp device (shared by a world group and
 * its sub-groups), a gloo::Context with one pair per peer, and the address of every peer's end
 * of its connection with us, so that a Gloo error message that names an address can be turned
 * into a rank. The connections are not Gloo's: gloo_mesh.c makes them and checks that each peer
 * holds the job's key, and the pairs here (MeshPair) take those sockets over and never accept
 * on the listening socket Gloo's pair opens. The C side (gloo_pg.c) calls in through
 * gloo_comm.h; every entry point catches every exception and returns a status and a message
 * instead.
 *
 * Collectives use Gloo's algorithms, except the reductions. Reduce-scatter, which Gloo only
 * offers as a class over bound buffers whose chunks are not pg.h's: here every rank posts
 * receives for its own chunk from every peer, sends each peer that peer's chunk, and reduces
 * segment by segment, in rank order, with fsdp__reduce() as the segments arrive. Each rank
 * sends and receives (size - 1) * count elements, the same volume as a ring, and the sums are
 * bitwise the sim backend's. All-reduce and reduce are that reduce-scatter over chunks of the
 * buffer followed by Gloo's allgatherv (all-reduce) or a gather of the chunks at the root
 * (reduce), so every reduction is the library's arithmetic, in rank order.
 */
#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/tcp/pair.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "backends/gloo/gloo_comm.h"
extern "C" {
#include "core/reduce.h"
}

namespace {

using Ms = std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;
using Buffer = std::unique_ptr<gloo::transport::UnboundBuffer>;

/* Slot prefix of our reduce-scatter; Gloo's own collectives use 0x01 to 0x08. */
constexpr uint8_t kReduceScatterSlotPrefix = 0x40;
/* Slot prefix of reduce's gather of the reduced chunks at the root. */
constexpr uint8_t kReduceGatherSlotPrefix = 0x41;
/* Reduce-scatter moves each peer's chunk in segments of this many bytes, with at most kWindow
 * segments per peer received ahead of the reduction. */
constexpr size_t kSegmentBytes = size_t(512) << 10;
constexpr size_t kWindow = 4;
/* Scratch space larger than this is freed after the collective that needed it. */
constexpr size_t kKeepScratchBytes = size_t(16) << 20;

/* Scratch memory that grows as needed and is not zeroed (a vector would write it once). */
class Scratch {
  public:
    void *get(size_t bytes) {
        if (bytes > cap_) {
            mem_.reset();
            cap_ = 0;
            mem_.reset(new unsigned char[bytes]);
            cap_ = bytes;
        }
        return mem_.get();
    }
    void trim() {
        if (cap_ > kKeepScratchBytes) {
            mem_.reset();
            cap_ = 0;
        }
    }

  private:
    std::unique_ptr<unsigned char[]> mem_;
    size_t cap_ = 0;
};

} // namespace

struct fsdp_gloo_comm {
    std::shared_ptr<gloo::transport::Device> dev;
    std::shared_ptr<gloo::Context> ctx;
    std::vector<std::string> peer_addr; /* [size]: the address of peer q's end of our pair */
    std::vector<std::string> peer_host; /* [size]: peer q's IP address, for messages */
    Scratch scratch; /* staging for f16/bf16, non-root reduce and reduce-scatter windows */
};

namespace {

/* ---------------------------------------------------------------------------------------- */
/* Errors: the one place where exceptions become status codes. */

bool contains(const std::string &hay, const char *needle) {
    return hay.find(needle) != std::string::npos;
}

/* Gloo's message without its "[file:line] " prefix. */
std::string strip_location(const char *what) {
    std::string s(what ? what : "");
    if (!s.empty() && s[0] == '[') {
        size_t end = s.find("] ");
        if (end != std::string::npos) s.erase(0, end + 2);
    }
    return s;
}

int classify(const std::string &what) {
    std::string low(what);
    for (auto &ch : low)
        ch = (char)std::tolower((unsigned char)ch);
    if (contains(low, "timed out") || contains(low, "timeout")) return FSDP_ETIMEDOUT;
    if (contains(low, "closed by peer") || contains(low, "connection reset") ||
        contains(low, "broken pipe") || contains(low, "read error") ||
        contains(low, "write error") || contains(low, "socket closed") ||
        contains(low, "connection refused"))
        return FSDP_EREMOTE;
    return FSDP_EBACKEND;
}

/* The rank whose address occurs in the message (followed by something other than a digit, so
 * that port 1234 does not match 12345); -1 when none does. */
int find_peer(const fsdp_gloo_comm *c, const std::string &what) {
    if (!c) return -1;
    for (size_t q = 0; q < c->peer_addr.size(); q++) {
        const std::string &a = c->peer_addr[q];
        if (a.empty()) continue;
        for (size_t pos = what.find(a); pos != std::string::npos; pos = what.find(a, pos + 1)) {
            size_t after = pos + a.size();
            if (after >= what.size() || !std::isdigit((unsigned char)what[after])) return (int)q;
        }
    }
    return -1;
}

void put(char *msg, size_t cap, const std::string &text) {
    if (cap) std::snprintf(msg, cap, "%s", text.c_str());
}

/* Maps the exception being handled to a status, a message and a peer. Called only from the
 * catch (...) handlers of the entry points. */
int translate(const fsdp_gloo_comm *c, int *peer, char *msg, size_t cap) {
    if (peer) *peer = -1;
    try {
        throw;
    } catch (const std::bad_alloc &) {
        put(msg, cap, "out of memory");
        return FSDP_ENOMEM;
    } catch (const std::exception &e) {
        std::string what = strip_location(e.what());
        put(msg, cap, what);
        if (peer) *peer = find_peer(c, what);
        return classify(what);
    } catch (...) {
        put(msg, cap, "unknown C++ exception");
        return FSDP_EBACKEND;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Connections */

namespace tcp = gloo::transport::tcp;

/* A Gloo tcp pair over a connection made elsewhere. Gloo's constructor opens a listening socket
 * and registers it with the device's loop; that socket is never accepted on (a stranger who
 * connects to it is ignored until adopt() closes it), and adopt() replaces it with the
 * authenticated connection, which Gloo then sets up as if it had accepted it. */
class MeshPair : public tcp::Pair {
  public:
    MeshPair(tcp::Context *context, tcp::Device *device, int peer, Ms timeout)
        : tcp::Pair(context, device, peer, timeout) {}

    /* Takes over fd, a connected socket to this pair's peer. */
    void adopt(int fd) {
        std::lock_guard<std::mutex> lock(m_);
        if (state_ != LISTENING) {
            ::close(fd);
            throw gloo::IoException("a pair was not waiting for its connection");
        }
        device_->unregisterDescriptor(fd_, this);
        ::close(fd_);
        fd_ = fd;
        handleConnected(); /* non-blocking, no delay, registered with the loop; CONNECTED */
        adopted_.store(true, std::memory_order_release);
    }

    void handleEvents(int events) override {
        if (!adopted_.load(std::memory_order_acquire)) return; /* Gloo's own listener */
        tcp::Pair::handleEvents(events);
    }

  private:
    std::atomic<bool> adopted_{false};
};

/* The tcp transport context, making MeshPairs. */
class MeshTransport : public tcp::Context {
  public:
    MeshTransport(std::shared_ptr<tcp::Device> device, int self, int n)
        : tcp::Context(std::move(device), self, n) {}

    std::unique_ptr<gloo::transport::Pair> &createPair(int peer) override {
        pairs_[peer] = std::unique_ptr<gloo::transport::Pair>(
            new MeshPair(this, device_.get(), peer, getTimeout()));
        return pairs_[peer];
    }
};

/* A gloo::Context whose pairs are the given connections. */
class MeshContext : public gloo::Context {
  public:
    MeshContext(int self, int n) : gloo::Context(self, n) {}

    /* Takes over fds[q] (every q but our rank), closing those it could not use. */
    void adopt(const std::shared_ptr<gloo::transport::Device> &dev, int *fds) {
        device_ = dev;
        auto tdev = std::dynamic_pointer_cast<tcp::Device>(dev);
        if (!tdev) throw gloo::IoException("the group's device is not a tcp device");
        auto t = std::make_shared<MeshTransport>(tdev, rank, size);
        t->setTimeout(getTimeout());
        transportContext_ = t;
        for (int q = 0; q < size; q++) {
            if (q == rank) continue;
            int fd = fds[q];
            fds[q] = -1;
            static_cast<MeshPair *>(t->createPair(q).get())->adopt(fd);
        }
    }
};

void close_fds(int *fds, int size) {
    for (int q = 0; q < size; q++)
        if (fds[q] >= 0) ::close(fds[q]), fds[q] = -1;
}

void connect(fsdp_gloo_comm *c, int rank, int size, int *fds, int64_t timeout_ms) {
    /* What Gloo will print as the other end of each connection (its peer_ address). */
    c->peer_addr.assign((size_t)size, std::string());
    c->peer_host.assign((size_t)size, std::string());
    for (int q = 0; q < size; q++) {
        if (q == rank) continue;
        c->peer_addr[(size_t)q] = tcp::Address::fromPeerName(fds[q]).str();
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        char host[INET6_ADDRSTRLEN] = "";
        if (getpeername(fds[q], (struct sockaddr *)&ss, &len) == 0) {
            if (ss.ss_family == AF_INET)
                inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, host, sizeof host);
            else if (ss.ss_family == AF_INET6)
                inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, host, sizeof host);
        }
        c->peer_host[(size_t)q] = host;
    }
    auto ctx = std::make_shared<MeshContext>(rank, size);
    ctx->setTimeout(Ms(timeout_ms));
    c->ctx = ctx;
    ctx->adopt(c->dev, fds);
}

/* ---------------------------------------------------------------------------------------- */
/* Collectives */

void reduce_or_throw(void *out, const void *const *ins, int nin, size_t n, fsdp_dtype_t dt,
                     fsdp_redop_t op, int divisor, double prescale) {
    void *outs[1] = {out};
    if (fsdp__reduce(outs, 1, ins, nin, n, dt, op, divisor, prescale) < 0) throw std::bad_alloc();
}

/* Calls f with a value of the unsigned type of `size` bytes (Gloo's options are templates on
 * the element type but only use its size). */
template <typename F> void with_type(size_t size, F f) {
    switch (size) {
    case 1:
        f(uint8_t());
        break;
    case 2:
        f(uint16_t());
        break;
    case 4:
        f(uint32_t());
        break;
    default:
        f(uint64_t());
        break;
    }
}

Buffer unbound(fsdp_gloo_comm *c, const void *p, size_t bytes) {
    /* Gloo only reads the buffers it sends from, but takes them non-const. */
    return c->ctx->createUnboundBuffer(const_cast<void *>(p), bytes);
}

void all_gather(fsdp_gloo_comm *c, const fsdp_gloo_op_t *op) {
    const size_t es = fsdp_dtype_size(op->dtype), bytes = op->count * es;
    const size_t n = (size_t)c->ctx->size, r = (size_t)c->ctx->rank;
    char *recv = static_cast<char *>(op->recv);
    gloo::AllgatherOptions o(c->ctx);
    with_type(es, [&](auto t) {
        using T = decltype(t);
        if (op->send != recv + r * bytes) o.setInput<T>(unbound(c, op->send, bytes));
        o.setOutput<T>(unbound(c, recv, n * bytes));
    });
    o.setTag(op->tag);
    o.setTimeout(Ms(op->timeout_ms));
    gloo::allgather(o);
}

void broadcast(fsdp_gloo_comm *c, const fsdp_gloo_op_t *op) {
    const size_t es = fsdp_dtype_size(op->dtype), bytes = op->count * es;
    gloo::BroadcastOptions o(c->ctx);
    with_type(es, [&](auto t) {
        using T = decltype(t);
        if (c->ctx->rank == op->root && op->send != op->recv)
            o.setInput<T>(unbound(c, op->send, bytes));
        o.setOutput<T>(unbound(c, op->recv, bytes));
    });
    o.setRoot(op->root);
    o.setTag(op->tag);
    o.setTimeout(Ms(op->timeout_ms));
    gloo::broadcast(o);
}

void all_to_all(fsdp_gloo_comm *c, const fsdp_gloo_op_t *op) {
    const size_t es = fsdp_dtype_size(op->dtype);
    const size_t bytes = op->count * es * (size_t)c->ctx->size;
    gloo::AlltoallOptions o(c->ctx);
    with_type(es, [&](auto t) {
        using T = decltype(t);
        o.setInput<T>(unbound(c, op->send, bytes));
        o.setOutput<T>(unbound(c, op->recv, bytes));
    });
    o.setTag(op->tag);
    o.setTimeout(Ms(op->timeout_ms));
    gloo::alltoall(o);
}

void barrier(fsdp_gloo_comm *c, const fsdp_gloo_op_t *op) {
    gloo::BarrierOptions o(c->ctx);
    o.setTag(op->tag);
    o.setTimeout(Ms(op->timeout_ms));
    gloo::barrier(o);
}

/* A reduction over one rank: what the sim backend computes (a copy, avg divides by 1, bool is
 * normalized, f16/bf16 go through f32 exactly). */
void reduce_alone(const fsdp_gloo_op_t *op) {
    const void *ins[1] = {op->send};
    reduce_or_throw(op->recv, ins, 1, op->count, op->dtype, op->op, 1, op->prescale);
}

/*
 * The rank-ordered reduce-scatter under both reduce_scatter and all_reduce: rank q's chunk is
 * elements [off[q], off[q] + len[q]) of every rank's `send`; rank r receives chunk r of every
 * peer's input and reduces the n chunks in rank order into `out` (len[r] elements). The chunk
 * travels in segments; up to kWindow segments per peer are received ahead of the reduction,
 * into scratch, and each receive is re-posted as soon as its segment has been reduced. Sends
 * are all posted at once (Gloo's tcp transport moves a send only once the matching receive is
 * posted, so they never overrun the window). out may be send's chunk r, which no send reads.
 */
void rs_chunks(fsdp_gloo_comm *c, const void *send_v, void *out_v, const size_t *off,
               const size_t *len, fsdp_dtype_t dt, fsdp_redop_t rop, double prescale,
               uint32_t tag, int64_t timeout_ms) {
    const int n = c->ctx->size, r = c->ctx->rank;
    const size_t es = fsdp_dtype_size(dt);
    const size_t seg_elems = std::max<size_t>(1, kSegmentBytes / es), seg = seg_elems * es;
    auto nseg_of = [&](int q) { return (len[q] + seg_elems - 1) / seg_elems; };
    const size_t nseg = nseg_of(r), win = std::min(kWindow, nseg);
    const char *send = static_cast<const char *>(send_v);
    char *out = static_cast<char *>(out_v);
    char *scratch =
        win ? static_cast<char *>(c->scratch.get((size_t)(n - 1) * win * seg)) : nullptr;
    const Clock::time_point deadline = Clock::now() + Ms(timeout_ms);
    auto left = [&]() {
        auto ms = std::chrono::duration_cast<Ms>(deadline - Clock::now());
        return std::max(ms, Ms(1));
    };
    /* Bytes of segment s of rank q's chunk. */
    auto seg_len_of = [&](int q, size_t s) { return std::min(seg, len[q] * es - s * seg); };
    auto seg_len = [&](size_t s) { return seg_len_of(r, s); };
    /* Peer q's window: the (q < r ? q : q - 1)-th region of the scratch. */
    auto region = [&](int q) { return scratch + (size_t)(q < r ? q : q - 1) * win * seg; };
    const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);

    size_t total = 0, nsends = 0;
    for (int q = 0; q < n; q++) {
        total = std::max(total, off[q] + len[q]);
        if (q != r) nsends += nseg_of(q);
    }
    Buffer in = total ? unbound(c, send, total * es) : nullptr;
    std::vector<Buffer> win_buf((size_t)n);
    if (win)
        for (int q = 0; q < n; q++)
            if (q != r) win_buf[(size_t)q] = unbound(c, region(q), win * seg);
    for (size_t s = 0; s < win; s++)
        for (int q = 0; q < n; q++)
            if (q != r) win_buf[(size_t)q]->recv(q, slot, s * seg, seg_len(s));
    /* Segment by segment, each to the ranks after us first, so that no rank is everybody's
     * first destination. */
    size_t most = 0;
    for (int q = 0; q < n; q++)
        if (q != r) most = std::max(most, nseg_of(q));
    for (size_t s = 0; s < most; s++)
        for (int k = 1; k < n; k++) {
            int q = (r + k) % n;
            if (s < nseg_of(q)) in->send(q, slot, off[q] * es + s * seg, seg_len_of(q, s));
        }
    std::vector<const void *> ins((size_t)n);
    for (size_t s = 0; s < nseg; s++) {
        for (int q = 0; q < n; q++) {
            if (q == r) {
                ins[(size_t)q] = send + off[r] * es + s * seg;
                continue;
            }
            if (!win_buf[(size_t)q]->waitRecv(nullptr, left()))
                throw gloo::IoException("reduce_scatter: a receive was aborted");
            ins[(size_t)q] = region(q) + (s % win) * seg;
        }
        reduce_or_throw(out + s * seg, ins.data(), n, seg_len(s) / es, dt, rop, n, prescale);
        if (s + win < nseg)
            for (int q = 0; q < n; q++)
                if (q != r) win_buf[(size_t)q]->recv(q, slot, (s % win) * seg, seg_len(s + win));
    }
    for (size_t i = 0; i < nsends; i++)
        if (!in->waitSend(nullptr, left()))
            throw gloo::IoException("reduce_scatter: a send was aborted");
}

/* Reduce-scatter: rs_chunks over n equal chunks of op->count elements. */
void reduce_scatter(fsdp_gloo_comm *c, const fsdp_gloo_op_t *op) {
    const int n = c->ctx->size;
    if (n == 1) return reduce_alone(op);
    std::vector<size_t> off((size_t)n), len((size_t)n, op->count);
    for (int q = 0; q < n; q++)
        off[(size_t)q] = (size_t)q * op->count;
    rs_chunks(c, op->send, op->recv, off.data(), len.data(), op->dtype, op->op, op->prescale,
              op->tag, op->timeout_ms);
}

/*
 * All-reduce: the count is cut into n nearly equal chunks (the first count % n one element
 * longer); rs_chunks reduces chunk r into recv in rank order, then Gloo's allgatherv gathers
 * the chunks in place. Each rank sends and receives 2 (n - 1) / n of the buffer, as a ring does,
 * and the result is bitwise the sim backend's at every group size. The 16-bit floats travel as
 * they are: the reduction widens them to f32 and rounds once.
 */
void all_reduce(fsdp_gloo_comm *c, const fsdp_gloo_op_t *op) {
    const int n = c->ctx->size, r = c->ctx->rank;
    if (n == 1) return reduce_alone(op);
    const size_t es = fsdp_dtype_size(op->dtype);
    std::vector<size_t> off((size_t)n), len((size_t)n);
    for (int q = 0, at = 0; q < n; q++) {
        len[(size_t)q] = op->count / (size_t)n + ((size_t)q < op->count % (size_t)n ? 1 : 0);
        off[(size_t)q] = (size_t)at;
        at += (int)len[(size_t)q];
    }
    char *recv = static_cast<char *>(op->recv);
    rs_chunks(c, op->send, recv + off[(size_t)r] * es, off.data(), len.data(), op->dtype, op->op,
              op->prescale, op->tag, op->timeout_ms);
    if (op->count == 0) return;
    gloo::AllgathervOptions o(c->ctx);
    with_type(es, [&](auto t) {
        using T = decltype(t);
        o.setOutput<T>(unbound(c, recv, op->count * es), len);
    });
    o.setTag(op->tag);
    o.setTimeout(Ms(op->timeout_ms));
    gloo::allgatherv(o);
}

/*
 * Reduce: the chunks of all_reduce, each reduced in rank order by its rank (rs_chunks), then
 * gathered at the root: every other rank sends its chunk to the root, which receives it in
 * place in recv. Each rank sends (n - 1) / n of the buffer in the first phase and its chunk in
 * the second, about what Gloo's ring reduce moves, and the root's result is bitwise the sim
 * backend's at every group size (fsdp__reduce over the n inputs in rank order, element by
 * element). Non-roots reduce their chunk into a buffer of their own, since their recv may be
 * NULL. In place (send == recv at the root) works as in all_reduce: rs_chunks writes only the
 * root's own chunk, which no send reads, and the gather starts after every send completed.
 */
void reduce(fsdp_gloo_comm *c, const fsdp_gloo_op_t *op) {
    const int n = c->ctx->size, r = c->ctx->rank;
    if (n == 1) return reduce_alone(op);
    const bool root = r == op->root;
    const size_t es = fsdp_dtype_size(op->dtype);
    std::vector<size_t> off((size_t)n), len((size_t)n);
    for (int q = 0, at = 0; q < n; q++) {
        len[(size_t)q] = op->count / (size_t)n + ((size_t)q < op->count % (size_t)n ? 1 : 0);
        off[(size_t)q] = (size_t)at;
        at += (int)len[(size_t)q];
    }
    const size_t mine = len[(size_t)r] * es;
    std::vector<char> own(root ? 0 : mine);
    char *out = root ? static_cast<char *>(op->recv) + off[(size_t)r] * es : own.data();
    rs_chunks(c, op->send, out, off.data(), len.data(), op->dtype, op->op, op->prescale, op->tag,
              op->timeout_ms);
    if (op->count == 0) return;
    const uint64_t slot = gloo::Slot::build(kReduceGatherSlotPrefix, op->tag);
    const Clock::time_point deadline = Clock::now() + Ms(op->timeout_ms);
    auto left = [&]() {
        auto ms = std::chrono::duration_cast<Ms>(deadline - Clock::now());
        return std::max(ms, Ms(1));
    };
    if (!root) {
        if (mine == 0) return;
        Buffer b = unbound(c, out, mine);
        b->send(op->root, slot, 0, mine);
        if (!b->waitSend(nullptr, left()))
            throw gloo::IoException("reduce: the send to the root was aborted");
        return;
    }
    Buffer b = unbound(c, op->recv, op->count * es);
    int posted = 0;
    for (int q = 0; q < n; q++)
        if (q != r && len[(size_t)q] > 0) {
            b->recv(q, slot, off[(size_t)q] * es, len[(size_t)q] * es);
            posted++;
        }
    for (int i = 0; i < posted; i++)
        if (!b->waitRecv(nullptr, left()))
            throw gloo::IoException("reduce: a receive at the root was aborted");
}

} // namespace

/* ---------------------------------------------------------------------------------------- */
/* Entry points */

namespace {
tcp::attr device_attr(const char *hostname, const char *iface) {
    tcp::attr attr;
    if (iface && *iface)
        attr.iface = iface;
    else
        attr.hostname = hostname && *hostname ? hostname : "127.0.0.1";
    return attr;
}
} // namespace

extern "C" int fsdp__gloo_resolve(const char *hostname, const char *iface,
                                  struct sockaddr_storage *addr, socklen_t *addrlen, char *msg,
                                  size_t cap) {
    try {
        tcp::attr attr = tcp::CreateDeviceAttr(device_attr(hostname, iface));
        std::memcpy(addr, &attr.ai_addr, sizeof *addr);
        *addrlen = (socklen_t)attr.ai_addrlen;
        return FSDP_OK;
    } catch (...) {
        return translate(nullptr, nullptr, msg, cap);
    }
}

extern "C" int fsdp__gloo_comm_create(int rank, int size, const char *hostname, const char *iface,
                                      int *fds, int64_t timeout_ms, fsdp_gloo_comm_t **out,
                                      char *msg, size_t cap) {
    *out = nullptr;
    fsdp_gloo_comm *c = nullptr;
    try {
        std::unique_ptr<fsdp_gloo_comm> owned(new fsdp_gloo_comm());
        c = owned.get();
        c->dev = tcp::CreateDevice(device_attr(hostname, iface));
        connect(c, rank, size, fds, timeout_ms);
        *out = owned.release();
        return FSDP_OK;
    } catch (...) {
        close_fds(fds, size);
        return translate(c, nullptr, msg, cap);
    }
}

extern "C" int fsdp__gloo_comm_create_sub(fsdp_gloo_comm_t *parent, int rank, int size, int *fds,
                                          int64_t timeout_ms, fsdp_gloo_comm_t **out, char *msg,
                                          size_t cap) {
    *out = nullptr;
    fsdp_gloo_comm *c = nullptr;
    try {
        std::unique_ptr<fsdp_gloo_comm> owned(new fsdp_gloo_comm());
        c = owned.get();
        c->dev = parent->dev;
        connect(c, rank, size, fds, timeout_ms);
        *out = owned.release();
        return FSDP_OK;
    } catch (...) {
        close_fds(fds, size);
        return translate(c, nullptr, msg, cap);
    }
}

extern "C" int fsdp__gloo_comm_run(fsdp_gloo_comm_t *c, const fsdp_gloo_op_t *op, int *peer,
                                   char *msg, size_t cap) {
    *peer = -1;
    try {
        switch (op->kind) {
        case FSDP_COLL_ALL_GATHER:
            all_gather(c, op);
            break;
        case FSDP_COLL_REDUCE_SCATTER:
            reduce_scatter(c, op);
            break;
        case FSDP_COLL_ALL_REDUCE:
            all_reduce(c, op);
            break;
        case FSDP_COLL_BROADCAST:
            broadcast(c, op);
            break;
        case FSDP_COLL_REDUCE:
            reduce(c, op);
            break;
        case FSDP_COLL_ALL_TO_ALL:
            all_to_all(c, op);
            break;
        case FSDP_COLL_BARRIER:
            barrier(c, op);
            break;
        default:
            put(msg, cap, "unknown collective kind");
            return FSDP_EINTERNAL;
        }
        c->scratch.trim();
        return FSDP_OK;
    } catch (...) {
        c->scratch.trim();
        return translate(c, peer, msg, cap);
    }
}

extern "C" void fsdp__gloo_comm_peer_host(const fsdp_gloo_comm_t *c, int peer, char *buf,
                                          size_t cap) {
    if (!cap) return;
    buf[0] = '\0';
    if (c && peer >= 0 && (size_t)peer < c->peer_host.size())
        std::snprintf(buf, cap, "%s", c->peer_host[(size_t)peer].c_str());
}

extern "C" void fsdp__gloo_comm_close(fsdp_gloo_comm_t *c) {
    if (!c || !c->ctx) return;
    try {
        c->ctx->closeConnections();
    } catch (...) {
        /* Closing is best effort: the connections are being abandoned anyway. */
    }
}

extern "C" void fsdp__gloo_comm_destroy(fsdp_gloo_comm_t *c) {
    try {
        delete c;
    } catch (...) {
        /* Destructors of Gloo objects do not throw in practice; never let one escape. */
    }
}
