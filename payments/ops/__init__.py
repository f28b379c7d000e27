"""What operators read and do: the console's actions and sessions, and the counts /metrics shows.
It sits on top and may import every other wing.
"""
