"""kuberl services: actor, buffer, learner (and the planner), plus the code they share in common/."""
