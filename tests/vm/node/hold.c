/* LD_PRELOAD'ed into a shutdown tool by the real-node scenarios
 * (tests/vm/scenarios/killed-poweroff-f.sh, slow-poweroff-f.sh): the tool
 * is exec'd, so the agent sees it at once, and then waits
 * LASTGASP_HOLD_MS milliseconds before any of its own code runs, so that a
 * scenario can kill it before its reboot(2), or let it outlive the agent's
 * bound on a direct tool's proof. */
#include <stdlib.h>
#include <time.h>

__attribute__((constructor)) static void hold(void)
{
    const char *ms = getenv("LASTGASP_HOLD_MS");
    if (!ms)
        return;
    long n = strtol(ms, 0, 10);
    struct timespec t = { n / 1000, (n % 1000) * 1000000L };
    while (nanosleep(&t, &t) != 0) {
    }
}
