"""The stage-assignment ILP: the maths and problem types (`formulation`), one function per
constraint family (`constraints`), the solver run (`backend`), evaluation of an assignment."""
