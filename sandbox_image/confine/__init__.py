"""What confines a slot process and its programs: a seccomp filter, a private /tmp, private memory."""
