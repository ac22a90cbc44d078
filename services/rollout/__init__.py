"""The rollout role: rollout requests and OpenAI-compatible chat over preprocess + engines."""
