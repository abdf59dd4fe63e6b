"""What a cluster is, as data both sides of the login node read: its profiles and the shape a job takes on it. The
launcher (gptpar.launch) turns them into job scripts, the planner (gptpar.plan) into prices; neither imports the
other for them."""
