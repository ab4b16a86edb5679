# logind's PowerOff method over D-Bus (what `systemctl poweroff` calls, asked
# by another client: a desktop, a management agent): no shutdown tool runs.
SCENARIO="logind PowerOff over D-Bus"
trigger() { busctl call org.freedesktop.login1 /org/freedesktop/login1 org.freedesktop.login1.Manager PowerOff b false; }
