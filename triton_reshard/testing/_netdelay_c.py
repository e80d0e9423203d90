"""The C source of the userspace link emulator (:mod:`triton_reshard.testing.netdelay`), compiled with ``gcc`` on
first use. Kept as a string so that it ships inside the wheel with the Python files.

``netdelay PREFIX SPEC...``: one TAP port ``PREFIX<i>`` per ``SPEC`` = ``lat_ns:rate_bps:burst_bytes:loss_ppm``
(rate 0: unshaped), created in the namespace it runs in (IFF_VNET_HDR, TSO/checksum offload: GSO superframes pass
whole). It prints ``ready`` once every port exists, then acts as the switch: a frame read from port ``a`` is
dropped with probability ``loss[a]``, waits ``lat[a]`` (the one-way delay of the link it came from), then goes
to the port of its destination MAC (learned from source MACs; broadcast, multicast and unknown ones to every
other port) through that port's token bucket (``rate``, ``burst``: the downlink; a frame that would wait more
than 50 ms there is dropped, like ``tbf``'s queue; so is a frame beyond 100,000 held). Order is kept per
source and per destination. Frames up to 2 KiB are held in allocations of their own size, larger ones in
full-size buffers that are reused.

Control on stdin: a line ``s`` prints one line ``stats`` followed, per port, by ``rx_frames rx_bytes tx_frames
tx_bytes lost queue_drops write_errors``; end of file (the harness gone, however it died) ends the process, and so does
the harness's death itself (``PR_SET_PDEATHSIG``).
"""

C_SOURCE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define MAXP 256
#define BUFSZ (65536 + 1024)
#define VNET 10 /* struct virtio_net_hdr */
#define QLIMIT_NS 50000000ULL

#define SMALL 2048          /* frames up to this size are copied into an allocation of their own size */
#define MAX_INFLIGHT 100000 /* frames held at once, all ports (the netem path's queue limit, per node) */
#define MAX_FREE 256        /* full-size buffers kept for reuse */
typedef struct frame { struct frame *next; uint64_t t; int len; int src; int small; unsigned char data[BUFSZ]; } frame;
typedef struct { frame *head, *tail; } fifo;

static int np, fds[MAXP];
static fifo inq[MAXP], outq[MAXP];
static uint64_t lat[MAXP], burst[MAXP], loss_ppm[MAXP], tail_ns[MAXP];
static double ns_per_byte[MAXP];
#define NST 7
static unsigned long long st[MAXP][NST]; /* rx_frames rx_bytes tx_frames tx_bytes lost queue_drops write_errors */
static unsigned char macs[MAXP][6];
static int mac_port[MAXP], nmac;
static frame *freelist;
static int nfree, inflight;
static uint64_t rng = 0x9E3779B97F4A7C15ULL;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + ts.tv_nsec;
}
static frame *get(void) { /* a full-size buffer */
    frame *f = freelist;
    if (f) { freelist = f->next; nfree--; }
    else if (!(f = malloc(sizeof(frame)))) { perror("netdelay: malloc"); exit(3); }
    f->small = 0;
    return f;
}
static frame *shrink(frame *f) { /* a small frame: its own small allocation, the buffer back to the pool */
    frame *g = malloc(offsetof(frame, data) + f->len);
    if (!g) { perror("netdelay: malloc"); exit(3); }
    memcpy(g, f, offsetof(frame, data) + f->len);
    g->small = 1;
    f->next = freelist; freelist = f; nfree++;
    return g;
}
static void release(frame *f) { /* a buffer not counted in inflight */
    if (f->small || nfree >= MAX_FREE) free(f);
    else { f->next = freelist; freelist = f; nfree++; }
}
static void put(frame *f) { inflight--; release(f); }
static void push(fifo *q, frame *f) {
    f->next = NULL;
    if (q->tail) q->tail->next = f; else q->head = f;
    q->tail = f;
}
static frame *pop(fifo *q) {
    frame *f = q->head;
    q->head = f->next;
    if (!q->head) q->tail = NULL;
    return f;
}
static uint32_t rnd(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (uint32_t)(rng >> 11); }

static int tap_open(const char *name) {
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) { perror("netdelay: /dev/net/tun"); exit(2); }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;
    strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0) { perror("netdelay: TUNSETIFF"); exit(2); }
    if (ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN) < 0) {
        perror("netdelay: TUNSETOFFLOAD"); exit(2);
    }
    return fd;
}

/* the downlink of port d: a token bucket of burst[d] bytes at the port's rate, FIFO */
static void to_port(int d, frame *f, uint64_t ready) {
    uint64_t dep = ready;
    if (ns_per_byte[d] > 0) {
        int len = f->len - VNET;
        uint64_t b = burst[d] > (uint64_t)len ? burst[d] : (uint64_t)len;
        uint64_t allow = (uint64_t)((double)(b - len) * ns_per_byte[d]);
        if (tail_ns[d] > allow && tail_ns[d] - allow > dep) dep = tail_ns[d] - allow;
        if (outq[d].tail && outq[d].tail->t > dep) dep = outq[d].tail->t;
        if (dep - ready > QLIMIT_NS) { st[d][5]++; put(f); return; }
        tail_ns[d] = (tail_ns[d] > dep ? tail_ns[d] : dep) + (uint64_t)(len * ns_per_byte[d]);
    }
    f->t = dep;
    push(&outq[d], f);
}

static void route(frame *f, uint64_t ready) {
    const unsigned char *dst = f->data + VNET;
    int d = -1;
    if (!(dst[0] & 1))
        for (int i = 0; i < nmac; i++)
            if (!memcmp(macs[i], dst, 6)) { d = mac_port[i]; break; }
    if (d >= 0) {
        if (d == f->src) put(f); else to_port(d, f, ready);
        return;
    }
    int last = -1;
    for (int p = 0; p < np; p++) {
        if (p == f->src) continue;
        if (last >= 0) {
            frame *c = f->small ? malloc(offsetof(frame, data) + f->len) : get();
            if (!c) { perror("netdelay: malloc"); exit(3); }
            memcpy(c, f, offsetof(frame, data) + f->len);
            inflight++;
            to_port(last, c, ready);
        }
        last = p;
    }
    if (last >= 0) to_port(last, f, ready); else put(f);
}

static void learn(int p, const unsigned char *src) {
    if (src[0] & 1) return;
    for (int i = 0; i < nmac; i++)
        if (!memcmp(macs[i], src, 6)) { mac_port[i] = p; return; }
    if (nmac < MAXP) { memcpy(macs[nmac], src, 6); mac_port[nmac++] = p; }
}

static void stats(void) {
    printf("stats");
    for (int p = 0; p < np; p++)
        for (int k = 0; k < NST; k++) printf(" %llu", st[p][k]);
    printf("\n");
    fflush(stdout);
}

static void read_port(int p) {
    for (int k = 0; k < 256; k++) {
        frame *f = get();
        ssize_t n = read(fds[p], f->data, BUFSZ);
        if (n < 0) { release(f); if (errno == EAGAIN || errno == EINTR) return; perror("netdelay: read"); exit(4); }
        if (n < VNET + 14) { release(f); continue; }
        uint64_t t = now_ns();
        st[p][0]++; st[p][1] += n - VNET;
        if (loss_ppm[p] && rnd() % 1000000 < loss_ppm[p]) { st[p][4]++; release(f); continue; }
        if (inflight >= MAX_INFLIGHT) { st[p][5]++; release(f); continue; }
        learn(p, f->data + VNET + 6);
        f->len = (int)n; f->src = p; f->t = t + lat[p];
        if (n <= SMALL) f = shrink(f);
        inflight++;
        push(&inq[p], f);
    }
}

int main(int argc, char **argv) {
    if (argc < 3 || argc - 2 > MAXP) { fprintf(stderr, "usage: netdelay PREFIX lat_ns:rate_bps:burst:loss_ppm...\n"); return 2; }
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() == 1) return 5; /* the harness is already gone */
    prctl(PR_SET_TIMERSLACK, 1UL);
    signal(SIGPIPE, SIG_IGN);
    np = argc - 2;
    for (int p = 0; p < np; p++) {
        double rate;
        unsigned long long l, b, lp;
        if (sscanf(argv[p + 2], "%llu:%lf:%llu:%llu", &l, &rate, &b, &lp) != 4) { fprintf(stderr, "netdelay: bad spec %s\n", argv[p + 2]); return 2; }
        lat[p] = l; burst[p] = b; loss_ppm[p] = lp;
        ns_per_byte[p] = rate > 0 ? 8e9 / rate : 0;
        char name[IFNAMSIZ];
        snprintf(name, sizeof name, "%s%d", argv[1], p);
        fds[p] = tap_open(name);
    }
    rng ^= (uint64_t)getpid() * 0x100000001B3ULL ^ now_ns();
    printf("ready\n");
    fflush(stdout);
    struct pollfd pf[MAXP + 1];
    for (;;) {
        uint64_t now = now_ns();
        for (;;) { /* frames whose link delay is over, in the order they became ready */
            int best = -1;
            uint64_t bt = UINT64_MAX;
            for (int p = 0; p < np; p++)
                if (inq[p].head && inq[p].head->t < bt) { bt = inq[p].head->t; best = p; }
            if (best < 0 || bt > now) break;
            route(pop(&inq[best]), bt);
        }
        uint64_t next = UINT64_MAX;
        for (int p = 0; p < np; p++) {
            while (outq[p].head && outq[p].head->t <= now) {
                frame *f = pop(&outq[p]);
                if (write(fds[p], f->data, f->len) == f->len) { st[p][2]++; st[p][3] += f->len - VNET; }
                else st[p][6]++; /* e.g. the port not up yet */
                put(f);
            }
            if (outq[p].head && outq[p].head->t < next) next = outq[p].head->t;
            if (inq[p].head && inq[p].head->t < next) next = inq[p].head->t;
        }
        for (int p = 0; p < np; p++) { pf[p].fd = fds[p]; pf[p].events = POLLIN; pf[p].revents = 0; }
        pf[np].fd = 0; pf[np].events = POLLIN; pf[np].revents = 0;
        struct timespec ts, *tsp = NULL;
        if (next != UINT64_MAX) {
            now = now_ns();
            uint64_t w = next > now ? next - now : 0;
            ts.tv_sec = w / 1000000000ULL; ts.tv_nsec = w % 1000000000ULL;
            tsp = &ts;
        }
        int r = ppoll(pf, np + 1, tsp, NULL);
        if (r < 0) { if (errno == EINTR) continue; perror("netdelay: ppoll"); return 4; }
        for (int p = 0; p < np; p++)
            if (pf[p].revents & POLLIN) read_port(p);
        if (pf[np].revents) {
            char buf[256];
            ssize_t n = read(0, buf, sizeof buf);
            if (n <= 0) return 0; /* the harness is gone */
            for (ssize_t i = 0; i < n; i++)
                if (buf[i] == 's') stats();
        }
    }
}
"""
