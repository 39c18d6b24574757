"""What the sandbox's own processes send each other: requests, answers, marker bytes, control messages."""
