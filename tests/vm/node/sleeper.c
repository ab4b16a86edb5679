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
 *
 * It prints one line at start and one at SIGTERM to stdout, which the
 * kubelet keeps as the container's log.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t term;

static void on_term(int sig) { (void)sig; term = 1; }

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    long term_ms = argc > 1 ? atol(argv[1]) : 0;
    struct sigaction sa = {0};
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    printf("%.3f start term_ms=%ld\n", now(), term_ms);
    fflush(stdout);
    while (!term)
        pause();
    printf("%.3f SIGTERM: stopping in %ld ms\n", now(), term_ms);
    fflush(stdout);
    struct timespec d = {term_ms / 1000, (term_ms % 1000) * 1000000L};
    while (nanosleep(&d, &d) != 0)
        ;
    printf("%.3f stopped\n", now());
    fflush(stdout);
    return 0;
}
