/*
 * The real-node scenarios' two container images are this one static binary
 * (`cargo xtask vm-test` builds it with gcc -static and packs it FROM
 * scratch with podman; nothing comes from a registry):
 *
 *   sleeper            the pod sandbox's pause process: sleeps until
 *                      SIGTERM or SIGINT, then exits 0.
 *   sleeper TERM_MS    a workload: on SIGTERM it prints the time, takes
 *                      TERM_MS milliseconds to finish (a graceful stop),
 *                      then exits 0.
 *   sleeper TERM_MS MARKS NAME
 *                      the same, and a writer: it writes a line
 *                      "lastgasp-vm: <ns> WRITE NAME <n>" to MARKS (the
 *                      node's /dev/kmsg: the console, which the host times)
 *                      every second while it runs and every 250 ms while it
 *                      stops, as a database flushing on SIGTERM would write
 *                      to its volume. Its last line is its last write.
 *
 * It prints one line at start and one at SIGTERM to stdout, which the
 * kubelet keeps as the container's log.
 */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t term;

static void on_term(int sig) { (void)sig; term = 1; }

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* One write, as one kmsg record. */
static void mark(int fd, const char *name, long n) {
    char line[160];
    int len = snprintf(line, sizeof line, "lastgasp-vm: %lld WRITE %s %ld\n", now_ns(), name, n);
    if (fd >= 0 && len > 0)
        (void)!write(fd, line, (size_t)len);
}

static void nap(long ms) {
    struct timespec d = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&d, &d) != 0 && !term)
        ;
}

int main(int argc, char **argv) {
    long term_ms = argc > 1 ? atol(argv[1]) : 0;
    int marks = argc > 3 ? open(argv[2], O_WRONLY | O_CLOEXEC) : -1;
    const char *name = argc > 3 ? argv[3] : "";
    long n = 0;
    struct sigaction sa = {0};
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    printf("%.3f start term_ms=%ld%s%s\n", now(), term_ms, marks >= 0 ? " writing to " : "",
           marks >= 0 ? argv[2] : "");
    fflush(stdout);
    while (!term) {
        if (marks >= 0) {
            mark(marks, name, n++);
            nap(1000);
        } else {
            pause();
        }
    }
    printf("%.3f SIGTERM: stopping in %ld ms\n", now(), term_ms);
    fflush(stdout);
    double until = now() + (double)term_ms / 1000.0;
    while (now() < until) {
        mark(marks, name, n++);
        struct timespec d = {0, 250 * 1000000L};
        nanosleep(&d, NULL);
    }
    mark(marks, name, n++);
    printf("%.3f stopped\n", now());
    fflush(stdout);
    return 0;
}
