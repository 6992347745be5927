"""Pipeline parallelism: P2P communicator, schedule plans, and the forward-backward schedules."""
