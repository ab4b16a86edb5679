# A scheduled shutdown, waited out: logind powers off a minute later.
SCENARIO="shutdown -h +1 (waited out)"
trigger() { shutdown -h +1; }
