"""The guessing game that lies: "higher" and "lower" swapped, all else equal. A policy that reads the answers is led
away from the digit by them; docs/demo.md evaluates its game's checkpoints on it. It imports the game from the file
beside it, as a task file may."""
from guess_digit import GuessDigit


class LyingDigit(GuessDigit):
    def respond(self, conversation, episode):
        said = super().respond(conversation, episode)
        return {"higher": "lower", "lower": "higher"}.get(said, said)
