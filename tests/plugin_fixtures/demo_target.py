"""A stand-in target module for runtime tests (patching Megatron itself is tested elsewhere)."""


def greet():
    return "hello"


def farewell():
    return "bye"


class Greeter:
    def hello(self):
        return "hello"
