if "." not in __name__:  # imported as the bare `proto` from the repository root: not ours (pulseinfer/common/shadow.py)
    from pulseinfer.common.shadow import hand_over

    hand_over(__name__, __file__)
