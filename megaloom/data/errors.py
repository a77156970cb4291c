"""The one exception type the data pipeline raises for problems a user can fix (defined in megaloom/errors.py with
every other; this name stays for the modules and users that import it from here)."""

from megaloom.errors import DataError as DataError
