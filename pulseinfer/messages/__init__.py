"""The vocabulary the processes speak: a step's plan and outcome, a request's sampling parameters, the
limits they obey, and their protobuf forms. The floor beneath scheduler/, gateway/ and gpu_worker/, which
import it and not each other."""
